"""Reads the config.json of the hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) into a QwenArch.

These interleave Gated DeltaNet linear-attention layers with gated full attention (``layer_types``), use
zero-centred RMSNorms ``x * (1 + w)`` (the GDN output norm excepted), partial RoPE and, for the MoE
models, routed experts plus a gated shared expert. As in :mod:`.hf_config`, every field is mapped, checked
or ignored by :data:`HYBRID_FIELD_POLICY`; a field not in it is an error. Qwen3.5 checkpoints are
multimodal (``Qwen3_5ForConditionalGeneration``): the text model is read from ``text_config`` and the
vision tower is left alone by the rule in :data:`LEFT_ALONE` (shown in the load report, copied back
byte-identical on export).
"""

from __future__ import annotations

from typing import Any

from .config_reading import (
    MOE_REQUIRED_FIELDS,
    REQUIRED_FIELDS,
    ConfigFields,
    HybridArch,
    QwenArch,
    UnsupportedConfigError,
    _number,
    _reject,
    require_fields,
    transformers_defaults,
)

# architecture -> (family, model_type of the config that holds the text fields, multimodal)
HYBRID_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "Qwen3NextForCausalLM": ("qwen3_next", "qwen3_next", False),
    "Qwen3_5ForCausalLM": ("qwen3_5", "qwen3_5_text", False),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "qwen3_5_moe_text", False),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5_text", True),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "qwen3_5_moe_text", True),
}
# Built from other blocks: refused with what differs (not mistaken for an unknown architecture).
REFUSED_ARCHITECTURES: dict[str, str] = {
    name: "transformers' qwen4_exp is not built from the Qwen3.5 blocks: it adds hyper-connections "
    "(hc_count residual streams mixed per layer), a QSA token indexer (sparse attention) on full-attention "
    "layers and a configurable output-gate activation, none of which megatron-core's GPT layers express"
    for name in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
}
# The multimodal config's own model_type, by family.
_MULTIMODAL_MODEL_TYPE = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}

# Checkpoint tensors that text training deliberately does not use: prefix -> why. The loader reports
# them by rule; export copies them back byte-identical.
LEFT_ALONE: dict[str, str] = {
    "model.visual.": "Qwen3.5 vision tower (text training leaves it untouched; export writes it back as read)",
    "mtp.": "multi-token-prediction head (transformers does not use it either; export writes it back as read)",
}

# Fields of the text config (top level for *ForCausalLM, ``text_config`` for the multimodal models).
HYBRID_FIELD_POLICY: dict[str, tuple[str, str]] = {
    "architectures": (
        "checked",
        "Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM (top level of the multimodal config)",
    ),
    "model_type": ("checked", "qwen3_next / qwen3_5_text / qwen3_5_moe_text, agreeing with `architectures`"),
    "num_hidden_layers": ("mapped", "--num-layers"),
    "hidden_size": ("mapped", "--hidden-size"),
    "intermediate_size": ("mapped", "--ffn-hidden-size (dense MLP; Qwen3.5-MoE has none)"),
    "num_attention_heads": ("mapped", "--num-attention-heads (full-attention layers)"),
    "num_key_value_heads": ("mapped", "--group-query-attention --num-query-groups"),
    "head_dim": ("mapped", "--kv-channels (default 256, as in transformers)"),
    "hidden_act": ("checked", "must be silu: --swiglu, and the GDN conv/output-gate activation"),
    "rms_norm_eps": ("mapped", "--normalization RMSNorm --norm-epsilon --apply-layernorm-1p (x * (1 + w))"),
    "vocab_size": ("mapped", "embedding/output rows (padded with zero rows to a multiple of TP)"),
    "max_position_embeddings": ("mapped", "--max-position-embeddings"),
    "rope_parameters": ("mapped", "rope_type default only; each key: the table below"),
    "rope_scaling": ("mapped", "legacy name of rope_parameters; when set it replaces it"),
    "rope_theta": ("mapped", "--rotary-base (rope_parameters.rope_theta wins)"),
    "partial_rotary_factor": (
        "mapped",
        "--rotary-percent (rope_parameters.partial_rotary_factor wins; default 0.25 as in transformers)",
    ),
    "tie_word_embeddings": ("mapped", "false -> --untie-embeddings-and-output-weights"),
    "attention_bias": ("checked", "must be false (no bias on q/k/v/o)"),
    "attention_dropout": ("mapped", "--attention-dropout"),
    "initializer_range": ("mapped", "--init-method-std"),
    "layer_types": (
        "mapped",
        "--experimental-attention-variant gated_delta_net --linear-attention-freq [1 = linear_attention, "
        "0 = full_attention] --attention-output-gate --qk-layernorm; default: full every 4th layer",
    ),
    "full_attention_interval": ("mapped", "legacy: layer_types with one full layer every N (when absent)"),
    "linear_conv_kernel_dim": ("mapped", "--linear-conv-kernel-dim"),
    "linear_key_head_dim": ("mapped", "--linear-key-head-dim"),
    "linear_value_head_dim": ("mapped", "--linear-value-head-dim"),
    "linear_num_key_heads": ("mapped", "--linear-num-key-heads"),
    "linear_num_value_heads": ("mapped", "--linear-num-value-heads (a multiple of the key heads)"),
    "num_experts": ("mapped", "--num-experts (Qwen3-Next: 0 -> dense MLP)"),
    "num_experts_per_tok": ("mapped", "--moe-router-topk"),
    "moe_intermediate_size": ("mapped", "--moe-ffn-hidden-size"),
    "shared_expert_intermediate_size": (
        "mapped",
        "--moe-shared-expert-intermediate-size --moe-shared-expert-gate",
    ),
    "norm_topk_prob": ("mapped", "Qwen3-Next: false -> --moe-router-pre-softmax (Qwen3.5-MoE: always true)"),
    "decoder_sparse_step": ("checked", "must be 1 (every layer MoE)"),
    "mlp_only_layers": ("checked", "must be empty"),
    "router_aux_loss_coef": ("mapped", "--moe-aux-loss-coeff (load balancing type aux_loss)"),
    "output_router_logits": ("ignored", "inference-time output switch"),
    "attn_output_gate": (
        "checked",
        "must be true (transformers' gated attention has no switch): --attention-output-gate",
    ),
    "output_gate_type": ("checked", "must be swish: the SiLU gate of the GDN output norm"),
    "mamba_ssm_dtype": (
        "ignored",
        "inference engines' recurrent-state dtype; training keeps the delta-rule state in fp32 (torch and fla)",
    ),
    "mtp_num_hidden_layers": (
        "ignored",
        "MTP head: transformers builds none; its mtp.* tensors are left alone",
    ),
    "mtp_use_dedicated_embeddings": ("ignored", "MTP head (see mtp_num_hidden_layers)"),
    "dtype": ("mapped", "bfloat16 -> --bf16, float16 -> --fp16"),
    "torch_dtype": ("mapped", "bfloat16 -> --bf16, float16 -> --fp16"),
    "quantization_config": ("checked", "must be absent: quantized checkpoints are not supported"),
    "bos_token_id": ("ignored", "tokenizer setting"),
    "eos_token_id": ("ignored", "tokenizer setting"),
    "pad_token_id": ("ignored", "tokenizer setting"),
    "use_cache": ("ignored", "inference-time cache switch"),
    "transformers_version": ("ignored", "provenance"),
    "_name_or_path": ("ignored", "provenance"),
    "output_attentions": ("ignored", "inference-time output switch"),
    "output_hidden_states": ("ignored", "inference-time output switch"),
    "return_dict": ("ignored", "inference-time output switch"),
}

# Top-level fields of the multimodal Qwen3.5 configs (the text model's fields sit in text_config).
MULTIMODAL_FIELD_POLICY: dict[str, tuple[str, str]] = {
    "architectures": ("checked", "Qwen3_5ForConditionalGeneration or Qwen3_5MoeForConditionalGeneration"),
    "model_type": ("checked", "qwen3_5 / qwen3_5_moe"),
    "text_config": ("mapped", "the language model: every field by the table above"),
    "vision_config": ("ignored", "vision tower, left alone on purpose (model.visual.* tensors)"),
    "language_model_only": (
        "ignored",
        "whether the checkpoint carries the vision tower: left alone either way",
    ),
    "image_token_id": ("ignored", "vision placeholder token (tokenizer setting)"),
    "video_token_id": ("ignored", "vision placeholder token (tokenizer setting)"),
    "vision_start_token_id": ("ignored", "vision placeholder token (tokenizer setting)"),
    "vision_end_token_id": ("ignored", "vision placeholder token (tokenizer setting)"),
    "tie_word_embeddings": ("mapped", "must agree with text_config.tie_word_embeddings when both are set"),
    "dtype": ("mapped", "bfloat16 -> --bf16, float16 -> --fp16 (text_config's wins)"),
    "torch_dtype": ("mapped", "legacy name of dtype"),
    "quantization_config": ("checked", "must be absent"),
    "transformers_version": ("ignored", "provenance"),
    "_name_or_path": ("ignored", "provenance"),
    "use_cache": ("ignored", "inference-time cache switch"),
}

HYBRID_ROPE_KEY_POLICY: dict[str, str] = {
    "rope_type": "must be default (plain RoPE); other scalings are refused",
    "type": "legacy name of rope_type",
    "rope_theta": "--rotary-base",
    "partial_rotary_factor": "--rotary-percent",
    "mrope_section": "Qwen3.5 multimodal RoPE: text tokens have equal t/h/w positions, so it is plain RoPE",
    "mrope_interleaved": "as mrope_section",
}


def is_hybrid_config(raw: dict[str, Any]) -> bool:
    archs = raw.get("architectures") or []
    return len(archs) == 1 and (archs[0] in HYBRID_ARCHITECTURES or archs[0] in REFUSED_ARCHITECTURES)


def hybrid_arch_from_raw(raw: dict[str, Any], where: str) -> QwenArch:
    """Validates a hybrid Qwen config (already known to name a hybrid architecture) and returns its arch."""
    arch_name = raw["architectures"][0]
    if arch_name in REFUSED_ARCHITECTURES:
        raise _reject(where, "architectures", [arch_name], REFUSED_ARCHITECTURES[arch_name])
    family, text_type, multimodal = HYBRID_ARCHITECTURES[arch_name]
    text = raw
    if multimodal:
        _check_fields(raw, MULTIMODAL_FIELD_POLICY, where)
        if raw.get("model_type") != _MULTIMODAL_MODEL_TYPE[family]:
            raise _reject(where, "model_type", raw.get("model_type"), f"{arch_name} needs {family!r}")
        if raw.get("quantization_config"):
            raise _reject(where, "quantization_config", "...", "load a bf16/fp16/fp32 checkpoint instead")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise _reject(where, "text_config", text, f"{arch_name} needs the language model's config")
        where = f"{where} text_config"
    else:
        text = {k: v for k, v in raw.items() if k != "architectures"}
    _check_fields(text, HYBRID_FIELD_POLICY, where)
    if text.get("model_type", text_type) != text_type:
        raise _reject(where, "model_type", text.get("model_type"), f"{arch_name} needs {text_type!r}")

    if family == "qwen3_next":  # num_experts 0 makes its MLPs dense
        moe = text.get("num_experts", transformers_defaults(text_type).get("num_experts")) != 0
    else:
        moe = family == "qwen3_5_moe"
    shape_fields = tuple(f for f in REQUIRED_FIELDS if f != "intermediate_size" or not moe)
    require_fields(text, shape_fields + (MOE_REQUIRED_FIELDS if moe else ()), where, arch_name)
    defaults = transformers_defaults(text_type)
    if multimodal and "tie_word_embeddings" in raw:  # the top level's, where text_config has none
        defaults = defaults | {"tie_word_embeddings": raw["tie_word_embeddings"]}
    fields = ConfigFields(text, where, defaults)
    get, count, real, flag = fields.get, fields.count, fields.real, fields.flag

    if get("hidden_act", "silu") != "silu":
        raise _reject(where, "hidden_act", text["hidden_act"], "only silu is supported")
    if flag("attention_bias"):
        raise _reject(
            where, "attention_bias", True, "megatron-core's gated attention has no q/k/v/o bias here"
        )
    if text.get("quantization_config"):
        raise _reject(where, "quantization_config", "...", "load a bf16/fp16/fp32 checkpoint instead")
    if not flag("attn_output_gate", True):
        raise _reject(
            where, "attn_output_gate", False, "transformers' Qwen3-Next/Qwen3.5 attention is always gated"
        )
    if get("output_gate_type", "swish") != "swish":
        raise _reject(
            where, "output_gate_type", text["output_gate_type"], "the GDN output gate is SiLU (swish)"
        )
    if get("decoder_sparse_step", 1) != 1:
        raise _reject(where, "decoder_sparse_step", text["decoder_sparse_step"], "every layer must be MoE")
    if get("mlp_only_layers", []):
        raise _reject(where, "mlp_only_layers", text["mlp_only_layers"], "every layer must be MoE")
    tied = flag("tie_word_embeddings")
    if multimodal and "tie_word_embeddings" in text and raw.get("tie_word_embeddings", tied) is not tied:
        raise _reject(where, "tie_word_embeddings", tied, "the top level's value differs")

    num_layers = count("num_hidden_layers")
    layer_types = _layer_types(text, num_layers, fields)
    rope_field, rope = _rope(text, where)
    rotary_percent = float(
        _number(
            rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)),
            where,
            "partial_rotary_factor",
        )
    )
    heads, hidden, head_dim = count("num_attention_heads"), count("hidden_size"), count("head_dim")
    kv_heads = count("num_key_value_heads")
    if heads % kv_heads:
        raise _reject(where, "num_key_value_heads", kv_heads, f"must divide num_attention_heads ({heads})")
    if not 0 < rotary_percent <= 1 or int(head_dim * rotary_percent) % 2:
        raise _reject(
            where, "partial_rotary_factor", rotary_percent, f"needs an even rotary dim of {head_dim}"
        )
    theta_field = f"{rope_field}.rope_theta" if rope.get("rope_theta") is not None else "rope_theta"
    rope_theta = _number(rope.get("rope_theta") or get("rope_theta"), where, theta_field)
    if rope_theta is None or rope_theta <= 0:
        raise _reject(where, theta_field, rope_theta, "must be a positive number")
    nk, nv = count("linear_num_key_heads"), count("linear_num_value_heads")
    if nv % nk:
        raise _reject(where, "linear_num_value_heads", nv, f"must be a multiple of linear_num_key_heads {nk}")
    num_experts = count("num_experts") if moe else 0
    shared = count("shared_expert_intermediate_size", minimum=0) if moe else 0
    dtype = get("dtype", get("torch_dtype", raw.get("dtype", raw.get("torch_dtype"))))
    return QwenArch(
        architecture=arch_name,
        family=family,
        num_layers=num_layers,
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP; megatron-core still wants a size (unused by MoE layers).
        ffn_hidden_size=count(
            "intermediate_size" if text.get("intermediate_size") or not moe else "moe_intermediate_size"
        ),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        norm_epsilon=real("rms_norm_eps", positive=True),
        vocab_size=count("vocab_size"),
        max_position_embeddings=count("max_position_embeddings"),
        rotary_base=float(rope_theta),
        tie_word_embeddings=tied,
        qkv_bias=False,
        qk_layernorm=True,
        attention_dropout=real("attention_dropout"),
        init_method_std=real("initializer_range"),
        dtype=str(dtype) if dtype else None,
        num_experts=num_experts if moe else None,
        moe_router_topk=count("num_experts_per_tok") if moe else None,
        moe_ffn_hidden_size=count("moe_intermediate_size") if moe else None,
        norm_topk_prob=flag("norm_topk_prob", True) if family == "qwen3_next" else True,
        shared_expert_intermediate_size=shared or None,
        moe_aux_loss_coeff=real("router_aux_loss_coef") if moe else 0.0,
        hybrid=HybridArch(
            layer_types=layer_types,
            conv_kernel=count("linear_conv_kernel_dim"),
            key_head_dim=count("linear_key_head_dim"),
            value_head_dim=count("linear_value_head_dim"),
            num_key_heads=nk,
            num_value_heads=nv,
            rotary_percent=rotary_percent,
            fused_projections=family == "qwen3_next",
            text_prefix="model.language_model." if multimodal else "model.",
            multimodal=multimodal,
        ),
    )


def _check_fields(cfg: dict[str, Any], policy: dict[str, tuple[str, str]], where: str) -> None:
    unknown = sorted(k for k in cfg if k not in policy)
    if unknown:
        raise UnsupportedConfigError(
            f"{where}: unknown field(s) {unknown}. twinkle-specs maps or rejects every config field "
            "explicitly (see docs/config-fields.md); a field it does not know may change the model."
        )


def _layer_types(text: dict[str, Any], num_layers: int, fields: ConfigFields) -> tuple[str, ...]:
    """transformers' rule: the given list, else one full-attention layer every full_attention_interval."""
    types, where = text.get("layer_types"), fields.where
    if types is None:
        interval = fields.count("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise _reject(
            where,
            "layer_types",
            types,
            f"needs {num_layers} entries, each linear_attention or full_attention",
        )
    return tuple(types)


def _rope(text: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    field = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rope = dict(text.get(field) or {})
    for key, value in rope.items():
        if key not in HYBRID_ROPE_KEY_POLICY:
            raise _reject(where, f"{field}.{key}", value, f"takes only {sorted(HYBRID_ROPE_KEY_POLICY)}")
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type != "default":
        raise _reject(where, f"{field}.rope_type", rope_type, "the hybrid models support plain RoPE only")
    return field, rope
