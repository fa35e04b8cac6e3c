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
# what the released Qwen3.5 language models share (transformers 5.17's Qwen3_5TextConfig and
# Qwen3_5MoeTextConfig defaults, set here explicitly; rope theta and positions are the checkpoints', not
# the classes' defaults of 10,000 and 32,768)
RELEASED_3_5 = {
    "vocab_size": 248320,
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "dtype": "bfloat16",
}
TINY_3_5 = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Shape:
    """A transformers config class, the default layer count and the config fields; hybrid (Gated
    DeltaNet) shapes: one full-attention layer every ``full_attention_every`` layers."""

    config_class: str
    layers: int
    fields: dict[str, Any]
    full_attention_every: int | None = None


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
    # The Qwen3.5-9B language model: 32 layers in the real one, 8 x (3 Gated DeltaNet, 1 gated full
    # attention). 4 by default (one such block): 2.90 B parameters, 2.03 B of them the untied embedding and
    # output layer (2 x 248320 x 4096), ~52 GB at ~18 bytes/parameter, so that full fine-tuning fits one
    # 80 GB H100 (as qwen3-8b's 8 layers). layer_types are derived from the layer count (hybrid_layer_types).
    "qwen3.5-9b": Shape(
        "Qwen3_5TextConfig",
        4,
        RELEASED_3_5
        | {"hidden_size": 4096, "intermediate_size": 12288}
        | {"num_attention_heads": 16, "num_key_value_heads": 4},
        full_attention_every=4,
    ),
    # The Qwen3.5-35B-A3B language model: 40 layers in the real one (256 experts of 512, top-8, a shared
    # expert of 512). 2 by default, [linear_attention, full_attention]: 2.70 B parameters (1.02 B embedding
    # and output layer, 0.81 B of experts per layer), ~49 GB at ~18 bytes/parameter; 3 layers would need
    # ~64 GB before activations, 4 ~79 GB.
    "qwen3.5-35b-a3b": Shape(
        "Qwen3_5MoeTextConfig",
        2,
        RELEASED_3_5
        | {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2}
        | {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512}
        | {"shared_expert_intermediate_size": 512},
        full_attention_every=4,
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
    # [linear_attention, full_attention] (hybrid_layer_types): the Gated DeltaNet runs twinkle_specs.gdn's
    # torch path on CPU
    "tiny-qwen3.5": Shape(
        "Qwen3_5TextConfig", 2, TINY_3_5 | {"intermediate_size": 128}, full_attention_every=4
    ),
    "tiny-qwen3.5-moe": Shape(
        "Qwen3_5MoeTextConfig",
        2,
        TINY_3_5
        | {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
        | {"num_experts": 4, "num_experts_per_tok": 2},
        full_attention_every=4,
    ),
}


def shape_name(shape: str, layers: int | None) -> str:
    return f"{shape}-L{layers}" if layers else shape


def hybrid_layer_types(layers: int, every: int) -> list[str]:
    """The released hybrids' pattern for ``layers`` layers: full attention on every ``every``-th layer,
    Gated DeltaNet on the others; where that leaves no full-attention layer (fewer than ``every`` layers)
    the last layer is one. Explicit, since transformers' default for a short model is all linear."""
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def hf_config(shape: str, layers: int | None = None):
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    import transformers

    spec = SHAPES[shape]
    n = layers or spec.layers
    fields = spec.fields | {"num_hidden_layers": n}
    if spec.full_attention_every:
        fields["layer_types"] = hybrid_layer_types(n, spec.full_attention_every)
    return getattr(transformers, spec.config_class)(**fields)


def write_config(shape: str, layers: int | None, out: Path) -> Path:
    """Writes config.json only (enough for building models with random weights), naming the causal-LM
    class transformers maps the config's model type to (Qwen3_5ForCausalLM for ``qwen3_5_text``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(shape, layers)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    return out
