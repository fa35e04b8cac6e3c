"""Binds megatron-core parameter names to the rows of the HF <-> megatron-core weight table.

The rows live in :mod:`.weight_rules` (the dense families) and :mod:`.weight_map_hybrid` (Qwen3-Next,
Qwen3.5); each pairs a parameter (a regex over its *canonical* name, see :func:`canonical_name`) with the
HF tensor(s) it is made of and a :class:`~.weight_rules.Layout` that says how they are fused and split
over tensor-parallel ranks. Loading and export both read this table, so every transform is written once
and applied in both directions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .config_reading import QwenArch
from .weight_map_hybrid import COMPILED_HYBRID, HYBRID_ALIASES, hf_names, hybrid_tensor_shapes
from .weight_rules import QKV as QKV
from .weight_rules import RULES, Layout

_COMPILED = tuple((re.compile(r.megatron + "$"), r) for r in RULES)

# Transformer Engine and grouped-GEMM parameter names -> the canonical (portable) names used in RULES.
_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (
        re.compile(r"mlp\.experts\.linear_fc(?P<fc>[12])\.weight(?P<e>\d+)$"),
        r"mlp.experts.local_experts.\g<e>.linear_fc\g<fc>.weight",
    ),
)


def canonical_name(name: str) -> str:
    """Maps TE fused-norm and grouped-expert names onto the portable names the table is written in."""
    for pattern, repl in _ALIASES:
        name = pattern.sub(repl, name)
    return name


@dataclass(frozen=True)
class Binding:
    """One megatron parameter of this rank bound to its HF tensors."""

    param_name: str
    hf_names: tuple[str, ...]
    layout: Layout
    expert: bool


def bind(
    name: str,
    arch: QwenArch,
    padded_vocab: int,
    global_layer: Callable[[int], int],
    global_expert: Callable[[int], int],
) -> Binding:
    """Finds the rule for megatron parameter ``name`` and fills in global layer/expert indices."""
    canon = canonical_name(name)
    compiled = _COMPILED
    if arch.hybrid is not None:
        compiled = COMPILED_HYBRID
        for pattern, repl in HYBRID_ALIASES:
            canon = pattern.sub(repl, canon)
    for pattern, rule in compiled:
        m = pattern.match(canon)
        if not m:
            continue
        fields = {}
        if "layer" in pattern.groupindex:
            fields["layer"] = global_layer(int(m["layer"]))
        if "expert" in pattern.groupindex:
            fields["expert"] = global_expert(int(m["expert"]))
        hf = rule.hf
        if rule.megatron.startswith(r"output_layer") and arch.tie_word_embeddings:
            hf = ("model.embed_tokens.weight",)
        names = tuple(t.format(**fields) for t in hf)
        if arch.hybrid is not None:
            names = hf_names(arch, rule, names)
        return Binding(name, names, rule.layout(arch, padded_vocab), rule.expert)
    raise KeyError(
        f"megatron parameter {name!r} has no Hugging Face source in twinkle_specs.weight_rules.RULES; "
        "refusing to leave it randomly initialised"
    )


def hf_tensor_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``arch`` holds, with its shape."""
    if arch.hybrid is not None:
        return hybrid_tensor_shapes(arch, _shared_tensor_shapes(arch))
    return _shared_tensor_shapes(arch)


def _shared_tensor_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    h, d = arch.hidden_size, arch.kv_channels
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (arch.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (arch.num_query_groups * d, h),
            p + "self_attn.v_proj.weight": (arch.num_query_groups * d, h),
            p + "self_attn.o_proj.weight": (h, arch.num_attention_heads * d),
        }
        if arch.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (arch.num_attention_heads * d,),
                p + "self_attn.k_proj.bias": (arch.num_query_groups * d,),
                p + "self_attn.v_proj.bias": (arch.num_query_groups * d,),
            }
        if arch.qk_layernorm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if not arch.is_moe:
            f = arch.ffn_hidden_size
            shapes |= {
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
            continue
        f = arch.moe_ffn_hidden_size or 0
        shapes[p + "mlp.gate.weight"] = (arch.num_experts or 0, h)
        for e in range(arch.num_experts or 0):
            q = f"{p}mlp.experts.{e}."
            shapes |= {
                q + "gate_proj.weight": (f, h),
                q + "up_proj.weight": (f, h),
                q + "down_proj.weight": (h, f),
            }
        if arch.shared_expert_intermediate_size:
            s = arch.shared_expert_intermediate_size
            shapes |= {
                p + "mlp.shared_expert.gate_proj.weight": (s, h),
                p + "mlp.shared_expert.up_proj.weight": (s, h),
                p + "mlp.shared_expert.down_proj.weight": (h, s),
                p + "mlp.shared_expert_gate.weight": (1, h),
            }
    return shapes
