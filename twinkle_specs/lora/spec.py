"""Composes LoRA wrappers into a layer's ModuleSpecs: each targeted linear's class is swapped for its
LoRA subclass, with the site and LoraConfig passed as spec params. Nothing else in the layer changes."""

from __future__ import annotations

import dataclasses

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
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


def _wrap(spec: ModuleSpec | type, site: str, sites: Sites, dropout: float) -> ModuleSpec | type:
    if site not in sites:
        return spec
    base, params = (spec.module, spec.params) if isinstance(spec, ModuleSpec) else (spec, {})
    lora_params = {"lora_site": site, "lora_slots": sites[site], "lora_dropout": dropout}
    return ModuleSpec(module=_wrapper_for(base), params={**params, **lora_params})


def _wrap_mlp(spec: ModuleSpec, prefix: str, sites: Sites, dropout: float) -> ModuleSpec:
    sub = spec.submodules
    if not isinstance(sub, MLPSubmodules):
        if f"{prefix}linear_fc1" in sites or f"{prefix}linear_fc2" in sites:
            raise NotImplementedError(
                f"LoRA cannot adapt {spec.module.__name__} (no per-linear submodules); use SequentialMLP "
                "or Transformer Engine grouped GEMM experts"
            )
        return spec
    sub = dataclasses.replace(
        sub,
        linear_fc1=_wrap(sub.linear_fc1, f"{prefix}linear_fc1", sites, dropout),
        linear_fc2=_wrap(sub.linear_fc2, f"{prefix}linear_fc2", sites, dropout),
    )
    return dataclasses.replace(spec, submodules=sub)


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
    attn_sub = dataclasses.replace(
        attn.submodules,
        linear_qkv=_wrap(attn.submodules.linear_qkv, "linear_qkv", sites, p),
        linear_proj=_wrap(attn.submodules.linear_proj, "linear_proj", sites, p),
    )
    mlp = submodules.mlp
    if isinstance(mlp.submodules, MoESubmodules):
        moe = mlp.submodules
        moe = dataclasses.replace(
            moe,
            experts=_wrap_mlp(moe.experts, "experts.", sites, p),
            shared_experts=moe.shared_experts and _wrap_mlp(moe.shared_experts, "", sites, p),
            router=_wrap(moe.router, "router", sites, p),
        )
        mlp = dataclasses.replace(mlp, submodules=moe)
    else:
        mlp = _wrap_mlp(mlp, "", sites, p)
    return dataclasses.replace(
        submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub), mlp=mlp
    )
