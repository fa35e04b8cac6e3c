"""Composes LoRA wrappers into a layer's specs: each targeted linear's class is swapped for its LoRA
subclass, with its site, slots (rank, scaling) and dropout passed as ModuleSpec params. Nothing else in
the layer changes. Works on megatron-core 0.16's ModuleSpecs and 0.19's builder partials alike."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from .config import LoraConfig, Sites
from .layers import LoraColumnParallelLinear, LoraRowParallelLinear, LoraTopKRouter

PORTABLE_WRAPPERS: dict[type, type] = {
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
    TopKRouter: LoraTopKRouter,
}


def _wrapper_for(base: type) -> type:
    if base in PORTABLE_WRAPPERS:
        return PORTABLE_WRAPPERS[base]
    if base.__module__ == "megatron.core.extensions.transformer_engine":
        from .te_layers import WRAPPERS

        if base in WRAPPERS:
            return WRAPPERS[base]
    raise TypeError(f"no LoRA wrapper for {base.__module__}.{base.__qualname__}")


def _wrap(spec: Any, site: str, sites: Sites, dropout: float) -> Any:
    """A linear's spec (class, ModuleSpec or builder partial) as a ModuleSpec of its LoRA wrapper."""
    if site not in sites:
        return spec
    if isinstance(spec, ModuleSpec):
        base, params = spec.module, spec.params
    elif isinstance(spec, functools.partial):
        base, params = spec.func, spec.keywords
    else:
        base, params = spec, {}
    lora_params = {"lora_site": site, "lora_slots": sites[site], "lora_dropout": dropout}
    return ModuleSpec(module=_wrapper_for(base), params={**params, **lora_params})


def _submodules(spec: Any) -> Any:
    """The submodules of a ModuleSpec (megatron-core 0.16) or of a builder partial (0.19)."""
    if isinstance(spec, ModuleSpec):
        return spec.submodules
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return None


def _with_submodules(spec: Any, submodules: Any) -> Any:
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=submodules)
    return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})


def _wrap_mlp(spec: Any, prefix: str, sites: Sites, dropout: float) -> Any:
    """An MLP-like spec (dense MLP, shared expert, experts) with its linear_fc1/fc2 wrapped."""
    sub = _submodules(spec)
    targeted = f"{prefix}linear_fc1" in sites or f"{prefix}linear_fc2" in sites
    if not hasattr(sub, "linear_fc1"):
        if targeted:
            raise NotImplementedError(
                f"LoRA cannot adapt {spec!r} (no per-linear submodules); use SequentialMLP or Transformer "
                "Engine grouped-GEMM experts"
            )
        return spec
    if not targeted:
        return spec
    sub = dataclasses.replace(
        sub,
        linear_fc1=_wrap(sub.linear_fc1, f"{prefix}linear_fc1", sites, dropout),
        linear_fc2=_wrap(sub.linear_fc2, f"{prefix}linear_fc2", sites, dropout),
    )
    return _with_submodules(spec, sub)


def lora_layer_submodules(
    submodules: TransformerLayerSubmodules, lora: LoraConfig, config: TransformerConfig
) -> TransformerLayerSubmodules:
    """``submodules`` with every linear that ``lora`` targets replaced by its LoRA wrapper.

    Qwen3-MoE (MoE with q/k norm, among the supported Qwen models) is the fused-expert model on which
    peft maps gate/up/down_proj to the routed experts; Qwen2-MoE's MLP names mean its shared expert.
    """
    sites = lora.resolve(
        fused_experts=bool(config.num_moe_experts) and config.qk_layernorm,
        shared_expert=bool(config.moe_shared_expert_intermediate_size),
    )
    p = lora.lora_dropout
    attn = submodules.self_attention
    attn_sub = _submodules(attn)
    attn_sub = dataclasses.replace(
        attn_sub,
        linear_qkv=_wrap(attn_sub.linear_qkv, "linear_qkv", sites, p),
        linear_proj=_wrap(attn_sub.linear_proj, "linear_proj", sites, p),
    )
    mlp = submodules.mlp
    moe = _submodules(mlp)
    if isinstance(moe, MoESubmodules):
        moe = dataclasses.replace(
            moe,
            experts=_wrap_mlp(moe.experts, "experts.", sites, p),
            shared_experts=moe.shared_experts and _wrap_mlp(moe.shared_experts, "", sites, p),
            router=_wrap(moe.router, "router", sites, p),
        )
        mlp = _with_submodules(mlp, moe)
    else:
        mlp = _wrap_mlp(mlp, "", sites, p)
    return dataclasses.replace(submodules, self_attention=_with_submodules(attn, attn_sub), mlp=mlp)
