"""Reads a Hugging Face Qwen ``config.json`` into a validated :class:`QwenArch`.

Every field a config.json may carry is listed in :data:`FIELD_POLICY`: it is either *mapped* (turned
into a Megatron setting), *checked* (accepted only with the value we can honour) or *ignored* (with the
reason). A field not in the table is an error, so nothing the checkpoint says is silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}


class UnsupportedConfigError(ValueError):
    """The checkpoint's config.json asks for something twinkle-specs cannot reproduce exactly."""


# field -> (policy, what happens). Policies: "mapped", "checked", "ignored". docs/config-fields.md is
# generated from this table (tests check it is current).
FIELD_POLICY: dict[str, tuple[str, str]] = {
    "architectures": ("checked", "one of Qwen2/Qwen3/Qwen3Moe/Qwen2MoeForCausalLM"),
    "model_type": ("checked", "must agree with `architectures`"),
    "num_hidden_layers": ("mapped", "--num-layers"),
    "hidden_size": ("mapped", "--hidden-size"),
    "intermediate_size": ("mapped", "--ffn-hidden-size (dense MLP)"),
    "num_attention_heads": ("mapped", "--num-attention-heads"),
    "num_key_value_heads": ("mapped", "--group-query-attention --num-query-groups"),
    "head_dim": ("mapped", "--kv-channels (default hidden_size / num_attention_heads)"),
    "hidden_act": ("checked", "must be silu: --swiglu"),
    "rms_norm_eps": ("mapped", "--normalization RMSNorm --norm-epsilon"),
    "vocab_size": ("mapped", "embedding/output rows (padded with zero rows to a multiple of TP)"),
    "max_position_embeddings": ("mapped", "--max-position-embeddings"),
    "rope_theta": ("mapped", "--rotary-base"),
    "rope_parameters": ("mapped", "rope_theta -> --rotary-base; rope_type must be default"),
    "rope_scaling": ("checked", "must be absent or rope_type default (YaRN not wired yet)"),
    "tie_word_embeddings": ("mapped", "false -> --untie-embeddings-and-output-weights"),
    "attention_bias": ("checked", "Qwen3: must be false (o_proj bias is not supported)"),
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


@dataclass(frozen=True)
class QwenArch:
    """The architecture facts of one Qwen checkpoint, in the units Megatron needs."""

    architecture: str
    family: str  # qwen2 | qwen3 | qwen3_moe | qwen2_moe
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    attention_dropout: float
    init_method_std: float
    dtype: str | None
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


def read_config_json(hf_dir: str | Path) -> dict[str, Any]:
    """Loads ``config.json`` from a checkpoint directory with an error that says what is missing."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --hf-model must be a Hugging Face checkpoint directory holding config.json"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedConfigError(f"{path} is not valid JSON: {err}") from err


def _reject(path: str, field: str, value: Any, what: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{path}: {field}={value!r} is not supported ({what}).")


def qwen_arch_from_hf(hf_dir: str | Path) -> QwenArch:
    """Validates a checkpoint's config.json against :data:`FIELD_POLICY` and returns its QwenArch."""
    raw = read_config_json(hf_dir)
    where = str(Path(hf_dir) / "config.json")
    unknown = sorted(k for k in raw if k not in FIELD_POLICY)
    if unknown:
        raise UnsupportedConfigError(
            f"{where}: unknown field(s) {unknown}. twinkle-specs maps or rejects every config field "
            "explicitly (see docs/config-fields.md); a field it does not know may change the model."
        )
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise _reject(where, "architectures", archs, f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("model_type", family) != family:
        raise _reject(where, "model_type", raw.get("model_type"), f"{arch} needs model_type {family!r}")

    def get(field: str, default: Any = None) -> Any:
        value = raw.get(field, default)
        return default if value is None else value

    if get("hidden_act", "silu") != "silu":
        raise _reject(where, "hidden_act", raw["hidden_act"], "only silu (SwiGLU) is supported")
    if get("use_sliding_window", False):
        raise _reject(where, "use_sliding_window", True, "sliding-window attention is not implemented")
    if any(t != "full_attention" for t in get("layer_types", [])):
        raise _reject(where, "layer_types", raw["layer_types"], "every layer must be full_attention")
    if raw.get("quantization_config"):
        raise _reject(where, "quantization_config", "...", "load a bf16/fp16/fp32 checkpoint instead")
    if get("use_mrope", False):
        raise _reject(where, "use_mrope", True, "multimodal rope is not supported")
    if family == "qwen3" and get("attention_bias", False):
        raise _reject(where, "attention_bias", True, "Megatron has no bias-on-o_proj-only option")
    if family.endswith("moe"):
        if get("decoder_sparse_step", 1) != 1:
            raise _reject(where, "decoder_sparse_step", raw["decoder_sparse_step"], "every layer must be MoE")
        if get("mlp_only_layers", []):
            raise _reject(where, "mlp_only_layers", raw["mlp_only_layers"], "every layer must be MoE")

    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope = dict(get("rope_parameters", {}) or {})
    rope.update(get("rope_scaling", {}) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _reject(
            where,
            "rope_scaling",
            rope,
            "only plain RoPE is supported (YaRN needs megatron-core >= 0.19 and is not wired yet)",
        )
    dtype = get("dtype", get("torch_dtype"))
    num_experts = raw.get("num_experts", raw.get("num_local_experts")) if family.endswith("moe") else None
    return QwenArch(
        architecture=arch,
        family=family,
        num_layers=int(raw["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(raw["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(get("num_key_value_heads", heads)),
        kv_channels=int(get("head_dim", hidden // heads)),
        norm_epsilon=float(get("rms_norm_eps", 1e-6)),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        rotary_base=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(get("qkv_bias", True))),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        attention_dropout=float(get("attention_dropout", 0.0)),
        init_method_std=float(get("initializer_range", 0.02)),
        dtype=str(dtype) if dtype else None,
        num_experts=int(num_experts) if num_experts else None,
        moe_router_topk=int(raw["num_experts_per_tok"]) if num_experts else None,
        moe_ffn_hidden_size=int(raw["moe_intermediate_size"]) if num_experts else None,
        norm_topk_prob=bool(get("norm_topk_prob", False)) if num_experts else True,
        shared_expert_intermediate_size=(
            int(raw["shared_expert_intermediate_size"])
            if family == "qwen2_moe" and get("shared_expert_intermediate_size", 0)
            else None
        ),
        moe_aux_loss_coeff=float(get("router_aux_loss_coef", 0.0)) if num_experts else 0.0,
    )
