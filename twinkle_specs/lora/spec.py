"""Composes LoRA wrappers into a layer's ModuleSpecs: each targeted linear's class is swapped for its
LoRA subclass, with the site and LoraConfig passed as spec params. Nothing else in the layer changes."""

from __future__ import annotations

import dataclasses

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from .config import LoraConfig
from .layers import LoraColumnParallelLinear, LoraRowParallelLinear

PORTABLE_WRAPPERS: dict[type, type] = {
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
}


def _wrapper_for(base: type) -> type:
    if base in PORTABLE_WRAPPERS:
        return PORTABLE_WRAPPERS[base]
    if base.__module__ == "megatron.core.extensions.transformer_engine":
        from .te_layers import WRAPPERS

        if base in WRAPPERS:
            return WRAPPERS[base]
    raise TypeError(f"no LoRA wrapper for {base.__module__}.{base.__qualname__}")


def _wrap(spec: ModuleSpec | type, site: str, lora: LoraConfig) -> ModuleSpec | type:
    if not lora.slots(site):
        return spec
    base, params = (spec.module, spec.params) if isinstance(spec, ModuleSpec) else (spec, {})
    return ModuleSpec(module=_wrapper_for(base), params={**params, "lora_site": site, "lora": lora})


def _wrap_mlp(spec: ModuleSpec, prefix: str, lora: LoraConfig) -> ModuleSpec:
    sub = spec.submodules
    if not isinstance(sub, MLPSubmodules):
        if lora.slots(f"{prefix}linear_fc1") or lora.slots(f"{prefix}linear_fc2"):
            raise NotImplementedError(
                f"LoRA cannot adapt {spec.module.__name__} (no per-linear submodules); use SequentialMLP "
                "or Transformer Engine grouped GEMM experts"
            )
        return spec
    sub = dataclasses.replace(
        sub,
        linear_fc1=_wrap(sub.linear_fc1, f"{prefix}linear_fc1", lora),
        linear_fc2=_wrap(sub.linear_fc2, f"{prefix}linear_fc2", lora),
    )
    return dataclasses.replace(spec, submodules=sub)


def lora_layer_submodules(
    submodules: TransformerLayerSubmodules, lora: LoraConfig
) -> TransformerLayerSubmodules:
    """``submodules`` with every linear that ``lora`` targets replaced by its LoRA wrapper."""
    attn = submodules.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules,
        linear_qkv=_wrap(attn.submodules.linear_qkv, "linear_qkv", lora),
        linear_proj=_wrap(attn.submodules.linear_proj, "linear_proj", lora),
    )
    mlp = submodules.mlp
    if isinstance(mlp.submodules, MoESubmodules):
        moe = mlp.submodules
        moe = dataclasses.replace(
            moe,
            experts=_wrap_mlp(moe.experts, "experts.", lora),
            shared_experts=moe.shared_experts and _wrap_mlp(moe.shared_experts, "", lora),
        )
        mlp = dataclasses.replace(mlp, submodules=moe)
    else:
        mlp = _wrap_mlp(mlp, "", lora)
    return dataclasses.replace(
        submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub), mlp=mlp
    )
