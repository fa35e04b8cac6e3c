"""Reads a Hugging Face Qwen ``config.json`` into a validated :class:`QwenArch`.

Every field a config.json may carry is listed in :data:`FIELD_POLICY`: it is either *mapped* (turned
into a Megatron setting), *checked* (accepted only with the value we can honour) or *ignored* (with the
reason). A field not in the table is an error, so nothing the checkpoint says is silently dropped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# The shared pieces live in config_reading; importers of this module keep finding them here.
from .config_reading import (
    MOE_REQUIRED_FIELDS as MOE_REQUIRED_FIELDS,
)
from .config_reading import (
    REQUIRED_FIELDS as REQUIRED_FIELDS,
)
from .config_reading import (
    ConfigFields,
    QwenArch,
    UnsupportedConfigError,
    YarnRope,
    _number,
    _reject,
    read_config_json,
    require_fields,
    transformers_defaults,
)
from .hybrid_config import HYBRID_ARCHITECTURES, hybrid_arch_from_raw, is_hybrid_config

SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}


# field -> (policy, what happens). Policies: "mapped", "checked", "ignored". docs/config-fields.md is
# generated from this table (tests check it is current).
FIELD_POLICY: dict[str, tuple[str, str]] = {
    "architectures": ("checked", "one of Qwen2/Qwen3/Qwen3Moe/Qwen2MoeForCausalLM"),
    "model_type": ("checked", "must agree with `architectures`"),
    "num_hidden_layers": ("mapped", "--num-layers"),
    "hidden_size": ("mapped", "--hidden-size"),
    "intermediate_size": ("mapped", "--ffn-hidden-size (dense MLP)"),
    "num_attention_heads": ("mapped", "--num-attention-heads"),
    "num_key_value_heads": (
        "mapped",
        "--group-query-attention --num-query-groups (absent: the transformers config class's default; "
        "null: num_attention_heads)",
    ),
    "head_dim": (
        "mapped",
        "--kv-channels (absent: the transformers config class's default, e.g. Qwen3 128; a class without "
        "one (Qwen2): hidden_size / num_attention_heads, as transformers' attention computes it)",
    ),
    "hidden_act": ("checked", "must be silu: --swiglu"),
    "rms_norm_eps": ("mapped", "--normalization RMSNorm --norm-epsilon"),
    "vocab_size": ("mapped", "embedding/output rows (padded with zero rows to a multiple of TP)"),
    "max_position_embeddings": (
        "mapped",
        "--max-position-embeddings (YaRN: also the factor when rope_parameters.factor is null)",
    ),
    "rope_theta": (
        "mapped",
        "--rotary-base (rope_parameters.rope_theta wins, as in transformers; Megatron-LM's flag is an int, "
        "the launcher gives GPTModel a fractional value exactly)",
    ),
    "rope_parameters": (
        "mapped",
        "rope_type default -> --position-embedding-type rope; yarn -> --position-embedding-type yarn "
        "and the YaRN flags (megatron-core >= 0.19 for the flags); each key: the table below",
    ),
    "rope_scaling": (
        "mapped",
        "legacy name of rope_parameters; when set it replaces it (as in transformers)",
    ),
    "original_max_position_embeddings": (
        "mapped",
        "YaRN: wins over rope_parameters.original_max_position_embeddings (as in transformers); "
        "unused otherwise",
    ),
    "tie_word_embeddings": ("mapped", "false -> --untie-embeddings-and-output-weights"),
    "attention_bias": (
        "checked",
        "Qwen3 / Qwen3-MoE: must be false (transformers then biases q/k/v and o_proj; Megatron can bias "
        "QKV alone or every linear layer, not QKV and the output projection)",
    ),
    "qkv_bias": ("mapped", "Qwen2-MoE: --add-qkv-bias"),
    "attention_dropout": ("mapped", "--attention-dropout"),
    "initializer_range": ("mapped", "--init-method-std"),
    "use_sliding_window": ("checked", "must be false"),
    "sliding_window": ("ignored", "only used when use_sliding_window is true"),
    "max_window_layers": ("ignored", "only used when use_sliding_window is true"),
    "layer_types": ("checked", "every layer must be full_attention"),
    "num_experts": ("mapped", "--num-experts"),
    "num_local_experts": ("mapped", "--num-experts"),
    "num_experts_per_tok": ("mapped", "--moe-router-topk"),
    "moe_intermediate_size": ("mapped", "--moe-ffn-hidden-size"),
    "norm_topk_prob": ("mapped", "false -> --moe-router-pre-softmax"),
    "decoder_sparse_step": ("checked", "must be 1 (every layer MoE)"),
    "mlp_only_layers": ("checked", "must be empty"),
    "shared_expert_intermediate_size": (
        "mapped",
        "Qwen2-MoE: --moe-shared-expert-intermediate-size --moe-shared-expert-gate (unused by Qwen3-MoE)",
    ),
    "router_aux_loss_coef": ("mapped", "--moe-aux-loss-coeff (load balancing type aux_loss)"),
    "output_router_logits": ("ignored", "inference-time output switch"),
    "dtype": ("mapped", "bfloat16 -> --bf16, float16 -> --fp16"),
    "torch_dtype": ("mapped", "bfloat16 -> --bf16, float16 -> --fp16"),
    "quantization_config": ("checked", "must be absent: quantized checkpoints are not supported"),
    "bos_token_id": ("ignored", "tokenizer setting"),
    "eos_token_id": ("ignored", "tokenizer setting"),
    "pad_token_id": ("ignored", "tokenizer setting"),
    "use_cache": ("ignored", "inference-time KV cache switch"),
    "transformers_version": ("ignored", "provenance"),
    "_name_or_path": ("ignored", "provenance"),
    "use_mrope": ("checked", "must be false"),
    "output_attentions": ("ignored", "inference-time output switch"),
    "output_hidden_states": ("ignored", "inference-time output switch"),
    "return_dict": ("ignored", "inference-time output switch"),
}

# rope_parameters / rope_scaling key -> (rope types that may carry it, what happens). Any other key is an
# error naming it. YaRN is computed as transformers' ``_compute_yarn_parameters`` does; megatron-core's
# YarnRotaryEmbedding has the same inv_freq formula, and its attention multiplies RoPE's cos and sin by
# the concentration factor it derives from (factor, mscale, mscale_all_dim), so every transformers
# attention_factor with factor > 1 is expressed through those two (see :class:`YarnRope`).
ROPE_KEY_POLICY: dict[str, tuple[str, str]] = {
    "rope_type": (
        "default, yarn",
        "default -> --position-embedding-type rope, yarn -> yarn; others rejected",
    ),
    "type": ("default, yarn", "legacy name of rope_type"),
    "rope_theta": ("default, yarn", "--rotary-base"),
    "partial_rotary_factor": ("default, yarn", "must be 1.0 (RoPE on the whole head)"),
    "factor": (
        "yarn",
        "--rotary-scaling-factor (config.yarn_rotary_scaling_factor); null -> "
        "max_position_embeddings / original_max_position_embeddings",
    ),
    "original_max_position_embeddings": (
        "yarn",
        "--yarn-original-max-position-embeddings; default max_position_embeddings",
    ),
    "beta_fast": ("yarn", "--yarn-beta-fast (null or 0 -> 32, as in transformers)"),
    "beta_slow": ("yarn", "--yarn-beta-slow (null or 0 -> 1, as in transformers)"),
    "truncate": (
        "yarn",
        "true (default) -> --yarn-correction-range-round-to-int, false/null -> --no-yarn-correction-range-round-to-int",
    ),
    "attention_factor": (
        "yarn",
        "cos/sin scale A: --mscale (A - 1) / (0.1 ln factor) --mscale-all-dim 0; with factor <= 1 it must "
        "be 1. Absent (and not both mscales): --mscale 1 --mscale-all-dim 0, i.e. 0.1 ln factor + 1",
    ),
    "mscale": ("yarn", "with mscale_all_dim (both non-zero, no attention_factor): --mscale; else unused"),
    "mscale_all_dim": (
        "yarn",
        "with mscale (both non-zero, no attention_factor): --mscale-all-dim; else unused",
    ),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' (and megatron-core's) ``get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def qwen_arch_from_hf(hf_dir: str | Path) -> QwenArch:
    """Validates a checkpoint's config.json against :data:`FIELD_POLICY` and returns its QwenArch."""
    raw = read_config_json(hf_dir)
    where = str(Path(hf_dir) / "config.json")
    if is_hybrid_config(raw):
        return hybrid_arch_from_raw(raw, where)
    unknown = sorted(k for k in raw if k not in FIELD_POLICY)
    if unknown:
        raise UnsupportedConfigError(
            f"{where}: unknown field(s) {unknown}. twinkle-specs maps or rejects every config field "
            "explicitly (see docs/config-fields.md); a field it does not know may change the model."
        )
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        supported = sorted(SUPPORTED_ARCHITECTURES) + sorted(HYBRID_ARCHITECTURES)
        raise _reject(where, "architectures", archs, f"supported: {supported}")
    arch = archs[0]
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("model_type", family) != family:
        raise _reject(where, "model_type", raw.get("model_type"), f"{arch} needs model_type {family!r}")

    moe_fields = [
        f
        for f in MOE_REQUIRED_FIELDS
        if not (f == "num_experts" and raw.get("num_local_experts") is not None)
    ]
    require_fields(raw, REQUIRED_FIELDS + (tuple(moe_fields) if family.endswith("moe") else ()), where, arch)
    fields = ConfigFields(raw, where, transformers_defaults(family))
    get, count, real, flag, defaults = fields.get, fields.count, fields.real, fields.flag, fields.defaults

    if get("hidden_act", "silu") != "silu":
        raise _reject(where, "hidden_act", raw["hidden_act"], "only silu (SwiGLU) is supported")
    if flag("use_sliding_window"):
        raise _reject(where, "use_sliding_window", True, "sliding-window attention is not implemented")
    if any(t != "full_attention" for t in get("layer_types", [])):
        raise _reject(where, "layer_types", raw["layer_types"], "every layer must be full_attention")
    if raw.get("quantization_config"):
        raise _reject(where, "quantization_config", "...", "load a bf16/fp16/fp32 checkpoint instead")
    if flag("use_mrope"):
        raise _reject(where, "use_mrope", True, "multimodal rope is not supported")
    if "attention_bias" in defaults and flag("attention_bias"):  # a field of the model type's class
        raise _reject(
            where,
            "attention_bias",
            True,
            f"{arch} then biases q/k/v and o_proj; Megatron has no QKV-and-output-projection-only bias",
        )
    if family.endswith("moe"):
        if get("decoder_sparse_step", 1) != 1:
            raise _reject(where, "decoder_sparse_step", raw["decoder_sparse_step"], "every layer must be MoE")
        if get("mlp_only_layers", []):
            raise _reject(where, "mlp_only_layers", raw["mlp_only_layers"], "every layer must be MoE")

    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    kv_heads = count("num_key_value_heads", heads)
    if heads % kv_heads:
        raise _reject(where, "num_key_value_heads", kv_heads, f"must divide num_attention_heads ({heads})")
    max_positions = count("max_position_embeddings")
    rope_field, rope, rope_type = _rope_parameters(raw, where)
    yarn = _yarn_rope(raw, rope, rope_field, where) if rope_type == "yarn" else None
    rope_theta_field = f"{rope_field}.rope_theta" if rope.get("rope_theta") is not None else "rope_theta"
    rope_theta = _number(rope.get("rope_theta") or get("rope_theta"), where, rope_theta_field)
    if rope_theta is None or rope_theta <= 0:
        raise _reject(where, rope_theta_field, rope_theta, "must be a positive number")
    dtype = get("dtype", get("torch_dtype"))
    num_experts = None
    if family.endswith("moe"):
        num_experts = count("num_experts" if "num_experts" in raw else "num_local_experts")
    shared = count("shared_expert_intermediate_size", 0, minimum=0) if family == "qwen2_moe" else 0
    return QwenArch(
        architecture=arch,
        family=family,
        num_layers=count("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=count("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=count("head_dim", hidden // heads),
        norm_epsilon=real("rms_norm_eps", positive=True),
        vocab_size=count("vocab_size"),
        max_position_embeddings=max_positions,
        rotary_base=float(rope_theta),
        tie_word_embeddings=flag("tie_word_embeddings"),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and flag("qkv_bias", True)),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        attention_dropout=real("attention_dropout"),
        init_method_std=real("initializer_range"),
        dtype=str(dtype) if dtype else None,
        num_experts=num_experts,
        moe_router_topk=count("num_experts_per_tok") if num_experts else None,
        moe_ffn_hidden_size=count("moe_intermediate_size") if num_experts else None,
        norm_topk_prob=flag("norm_topk_prob") if num_experts else True,
        shared_expert_intermediate_size=shared or None,
        moe_aux_loss_coeff=real("router_aux_loss_coef") if num_experts else 0.0,
        yarn=yarn,
    )


def _rope_parameters(raw: dict[str, Any], where: str) -> tuple[str, dict[str, Any], str]:
    """(field, parameters, rope type) as transformers reads them: a non-empty ``rope_scaling`` replaces
    ``rope_parameters`` whole; every key must be in :data:`ROPE_KEY_POLICY` for its rope type."""
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = dict(raw.get(field) or {})
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ("default", "yarn"):
        raise _reject(
            where,
            f"{field}.rope_type",
            rope_type,
            "supported: default (plain RoPE) and yarn; other scalings change the model",
        )
    accepted = sorted(k for k, (types, _) in ROPE_KEY_POLICY.items() if rope_type in types.split(", "))
    for key, value in rope.items():
        if key not in accepted:
            raise _reject(where, f"{field}.{key}", value, f"rope_type {rope_type} takes only {accepted}")
    if _number(rope.get("partial_rotary_factor", 1.0), where, f"{field}.partial_rotary_factor") != 1.0:
        raise _reject(
            where,
            f"{field}.partial_rotary_factor",
            rope["partial_rotary_factor"],
            "RoPE must cover the whole head",
        )
    return field, rope, rope_type


def _yarn_rope(raw: dict[str, Any], rope: dict[str, Any], field: str, where: str) -> YarnRope:
    """YaRN parameters resolved exactly as transformers 5's ``_compute_yarn_parameters`` (and its
    ``standardize_rope_params``) resolves them, in megatron-core's terms."""
    # A top-level original_max_position_embeddings wins; otherwise the rope dict's, else the model's.
    name, original = "original_max_position_embeddings", raw.get("original_max_position_embeddings")
    if original is None:
        name, original = (
            f"{field}.original_max_position_embeddings",
            rope.get("original_max_position_embeddings"),
        )
    if original is None:
        name, original = "max_position_embeddings", raw["max_position_embeddings"]
    if _number(original, where, name) <= 0 or int(original) != original:
        raise _reject(where, name, original, "YaRN needs a positive integer original context length")
    original = int(original)
    factor = rope.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    if _number(factor, where, f"{field}.factor") <= 0:
        raise _reject(where, f"{field}.factor", factor, "must be positive")
    factor = float(factor)
    attention_factor = _number(rope.get("attention_factor"), where, f"{field}.attention_factor")
    mscale = _number(rope.get("mscale"), where, f"{field}.mscale")
    mscale_all_dim = _number(rope.get("mscale_all_dim"), where, f"{field}.mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            megatron_mscale = (float(mscale), float(mscale_all_dim))
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:  # transformers ignores mscale unless both are non-zero
            megatron_mscale = (1.0, 0.0)
            attention_factor = _yarn_mscale(factor)
    else:
        attention_factor = float(attention_factor)
        if factor > 1:
            megatron_mscale = ((attention_factor - 1.0) / (0.1 * math.log(factor)), 0.0)
        elif attention_factor == 1.0:
            megatron_mscale = (1.0, 0.0)
        else:
            raise _reject(
                where,
                f"{field}.attention_factor",
                attention_factor,
                f"with factor {factor} <= 1 megatron-core's YaRN concentration factor is always 1",
            )
    megatron_factor = _yarn_mscale(factor, megatron_mscale[0]) / _yarn_mscale(factor, megatron_mscale[1])
    if not math.isclose(megatron_factor, attention_factor, rel_tol=1e-12):
        raise _reject(
            where,
            f"{field}.attention_factor",
            attention_factor,
            f"megatron-core would scale cos/sin by {megatron_factor}",
        )
    return YarnRope(
        field=field,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(_number(rope.get("beta_fast"), where, f"{field}.beta_fast") or 32),
        beta_slow=float(_number(rope.get("beta_slow"), where, f"{field}.beta_slow") or 1),
        mscale=megatron_mscale[0],
        mscale_all_dim=megatron_mscale[1],
        correction_range_round_to_int=bool(rope.get("truncate", True)),
        attention_factor=float(attention_factor),
    )
