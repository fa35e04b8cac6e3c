"""Model shapes benchmarked: Hugging Face configs of Qwen architectures with random weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

QWEN_VOCAB = 151936


def _qwen3_1_7b(layers: int | None):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=layers or 28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )


def _qwen2_5_1_5b(layers: int | None):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=layers or 28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )


def _qwen3_8b(layers: int | None):
    from transformers import Qwen3Config

    # 36 layers in the real model; 8 by default so that full fine-tuning (~18 bytes/parameter with
    # the distributed optimizer's fp32 main weights and Adam states) fits one 80 GB H100.
    return Qwen3Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers or 8,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _qwen3_30b_a3b(layers: int | None):
    from transformers import Qwen3MoeConfig

    # 48 layers in the real model; 4 by default (128 experts, top-8, as the real one) to fit full
    # fine-tuning on one GPU.
    return Qwen3MoeConfig(
        vocab_size=QWEN_VOCAB,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers or 4,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _tiny(layers: int | None):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers or 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def _tiny_moe(layers: int | None):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers or 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


SHAPES: dict[str, Callable] = {
    "qwen3-1.7b": _qwen3_1_7b,
    "qwen2.5-1.5b": _qwen2_5_1_5b,
    "qwen3-8b": _qwen3_8b,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    # CPU test shapes
    "tiny-qwen3": _tiny,
    "tiny-qwen3-moe": _tiny_moe,
}


def shape_name(shape: str, layers: int | None) -> str:
    return f"{shape}-L{layers}" if layers else shape


def hf_config(shape: str, layers: int | None = None):
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape](layers)


def write_config(shape: str, layers: int | None, out: Path) -> Path:
    """Writes config.json only (enough for building models with random weights)."""
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(shape, layers)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(out)
    return out
