"""Layer and block specs of the hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE).

Which layers are Gated DeltaNet and which full attention comes from megatron-core's own
``linear_attention_freq`` pattern (set from ``layer_types``), read per layer by
:class:`~twinkle_specs.spec.QwenTransformerLayer`, so one ``qwen_layer_spec`` serves every layer and
pipeline stage. Full-attention layers are megatron-core's SelfAttention with its output gate
(``attention_output_gate``); linear layers are :class:`~twinkle_specs.gdn.PortableGatedDeltaNet`. The
model's RMSNorms are zero-centred (``x * (1 + w)``, megatron's ``layernorm_zero_centered_gamma``): TE's
norms do that themselves, on the portable path :class:`ZeroCenteredRMSNorm` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from .gdn import PlainRMSNorm, PortableGatedDeltaNet


def is_hybrid(config: TransformerConfig) -> bool:
    return config.experimental_attention_variant == "gated_delta_net"


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``x / rms(x) * (1 + w)`` in fp32, cast back (transformers' Qwen3-Next / Qwen3.5 RMSNorm)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class PortableGatedSelfAttention(SelfAttention):
    """SelfAttention whose output gate is not ``torch.compile``d on CPU (compiling costs minutes there)."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return SelfAttention._apply_output_gate(self, x, gate)
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


def _te(config: TransformerConfig) -> bool:
    return config.transformer_impl == "transformer_engine"


def _gdn_spec(config: TransformerConfig) -> ModuleSpec:
    if _te(config):
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        # As megatron-core's own GDN spec: the layer's input norm is fused into in_proj.
        in_proj, out_proj = TELayerNormColumnParallelLinear, TERowParallelLinear
    else:
        in_proj, out_proj = ColumnParallelLinear, RowParallelLinear
    return ModuleSpec(
        module=PortableGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=in_proj, out_norm=PlainRMSNorm, out_proj=out_proj),
    )


def hybrid_layer_submodules(
    submodules: TransformerLayerSubmodules, config: TransformerConfig, layer_index: int
) -> TransformerLayerSubmodules:
    """``submodules`` (megatron-core's layer for this config) made layer ``layer_index`` (0-based, global)
    of a hybrid model: GDN or gated attention, and zero-centred norms on the portable path."""
    linear = get_linear_attention_pattern(config)[layer_index] == 1
    if _te(config):
        if linear:
            return dataclasses.replace(
                submodules, input_layernorm=IdentityOp, self_attention=_gdn_spec(config)
            )
        return submodules
    norm = ZeroCenteredRMSNorm
    keys_map = dict(submodules.sharded_state_dict_keys_map)
    if linear:
        attention: Any = _gdn_spec(config)
        # A TE model fuses this layer's input norm into in_proj (not linear_qkv, which it does not have):
        # checkpoint keys must be the ones a TE model of the same checkpoint loads, and the reverse.
        if "input_layernorm." in keys_map:
            keys_map["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    else:
        attention = submodules.self_attention
        attention = dataclasses.replace(
            attention,
            module=PortableGatedSelfAttention,
            submodules=dataclasses.replace(attention.submodules, q_layernorm=norm, k_layernorm=norm),
        )
    return dataclasses.replace(
        submodules,
        input_layernorm=norm,
        self_attention=attention,
        pre_mlp_layernorm=norm,
        sharded_state_dict_keys_map=keys_map,
    )


def hybrid_block_spec(config: TransformerConfig, layer_spec: ModuleSpec, vp_stage: int | None = None):
    """The block of this pipeline stage: ``layer_spec`` for each layer (it chooses per layer) and the final
    norm, zero-centred (portable: :class:`ZeroCenteredRMSNorm`; TE: TENorm reads the config)."""
    if _te(config):
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm: Any = TENorm
    else:
        final_norm = ZeroCenteredRMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=final_norm)
