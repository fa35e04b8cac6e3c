"""Model shapes benchmarked: Hugging Face configs of Qwen architectures with random weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

QWEN_VOCAB = 151936
# what the released Qwen checkpoints share
RELEASED = {"vocab_size": QWEN_VOCAB, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "dtype": "bfloat16"}
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class Shape:
    """A transformers config class, the default layer count and the config fields."""

    config_class: str
    layers: int
    fields: dict[str, Any]


SHAPES: dict[str, Shape] = {
    "qwen3-1.7b": Shape(
        "Qwen3Config",
        28,
        RELEASED
        | {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
        }
        | {"head_dim": 128, "max_position_embeddings": 40960, "tie_word_embeddings": True},
    ),
    "qwen2.5-1.5b": Shape(
        "Qwen2Config",
        28,
        RELEASED
        | {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        }
        | {"max_position_embeddings": 32768, "tie_word_embeddings": True},
    ),
    # 36 layers in the real model; 8 by default so that full fine-tuning (~18 bytes/parameter with the
    # distributed optimizer's fp32 main weights and Adam states) fits one 80 GB H100.
    "qwen3-8b": Shape(
        "Qwen3Config",
        8,
        RELEASED
        | {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        }
        | {"head_dim": 128, "max_position_embeddings": 40960, "tie_word_embeddings": False},
    ),
    # 48 layers in the real model; 4 by default (128 experts, top-8, as the real one) to fit full
    # fine-tuning on one GPU.
    "qwen3-30b-a3b": Shape(
        "Qwen3MoeConfig",
        4,
        RELEASED
        | {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768}
        | {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128}
        | {"num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960}
        | {"tie_word_embeddings": False},
    ),
    # CPU test shapes
    "tiny-qwen3": Shape("Qwen3Config", 2, TINY | {"tie_word_embeddings": False}),
    "tiny-qwen3-moe": Shape(
        "Qwen3MoeConfig",
        2,
        TINY
        | {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}
        | {"tie_word_embeddings": False},
    ),
}


def shape_name(shape: str, layers: int | None) -> str:
    return f"{shape}-L{layers}" if layers else shape


def hf_config(shape: str, layers: int | None = None):
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    import transformers

    spec = SHAPES[shape]
    return getattr(transformers, spec.config_class)(**spec.fields, num_hidden_layers=layers or spec.layers)


def write_config(shape: str, layers: int | None, out: Path) -> Path:
    """Writes config.json only (enough for building models with random weights)."""
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(shape, layers)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(out)
    return out
