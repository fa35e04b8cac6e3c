"""Tiny random hybrid Qwen checkpoints (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) built with transformers.

Odd shapes on purpose: a query-group size of 3, a vocabulary of 250 (not a multiple of 128), two value
heads per Gated DeltaNet key head, a rotary dim of a quarter head, and ``layer_types`` [linear, full,
full, linear] (not transformers' default, and both kinds on each of two pipeline stages).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

VOCAB = 250
SEQ = 80  # more than one 64-token chunk of the chunked delta rule, not a multiple of it
LAYER_TYPES = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=3,
    layer_types=LAYER_TYPES,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_MOE = dict(
    moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
)
_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=40,
    num_heads=2,
    out_hidden_size=48,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
)

HYBRID_KINDS = {
    "qwen3_next": lambda text: Qwen3NextConfig(**_MOE | text, intermediate_size=40, norm_topk_prob=True),
    "qwen3_5": lambda text: Qwen3_5TextConfig(**text, intermediate_size=40),
    "qwen3_5_moe": lambda text: Qwen3_5MoeTextConfig(**_MOE | text),
    "qwen3_5_vl": lambda text: Qwen3_5Config(
        text_config=text | dict(intermediate_size=40), vision_config=dict(_VISION)
    ),
    "qwen3_5_moe_vl": lambda text: Qwen3_5MoeConfig(text_config=_MOE | text, vision_config=dict(_VISION)),
}


def make_hybrid_checkpoint(kind: str, out: Path, seed: int = 0, **text) -> Path:
    """Saves a random tiny model of ``kind`` (``text``: language-model config fields to change, e.g. a
    larger vocabulary for a tokenizer or the MoE's sizes), its weights scaled so that a misplaced tensor shows."""
    torch.manual_seed(seed)
    config = HYBRID_KINDS[kind](copy.deepcopy(_TEXT) | text)
    # the multimodal checkpoints, as Qwen3.5 and Qwen3.5-MoE are released, with their vision tower
    multimodal = getattr(config, "vision_config", None) is not None
    model = (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # transformers' RMSNormGated: x * w
                p.uniform_(0.5, 1.5)
            elif "norm" in name:  # zero-centred: x * (1 + w)
                p.uniform_(-0.5, 0.5)
            elif "A_log" in name:
                p.uniform_(-1.0, 1.0)
            elif "dt_bias" in name:
                p.uniform_(-0.5, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


def hf_checkpoint_model(hf_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of a checkpoint as its config names it, in eval mode: a multimodal Qwen3.5
    checkpoint loads whole (its vision tower unused by text tokens), the model its PEFT adapters name."""
    from transformers import AutoConfig

    multimodal = AutoConfig.from_pretrained(hf_dir).architectures[0].endswith("ForConditionalGeneration")
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(hf_dir, dtype=dtype).eval()


def hybrid_hf_logits(hf_dir: Path, tokens: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """transformers' fp32 logits (the multimodal model on text-only tokens), computed on ``device`` (where
    fla is installed transformers runs its gated delta rule with fla's Triton kernels: CUDA only)."""
    with torch.no_grad():
        return hf_checkpoint_model(hf_dir).to(device)(tokens.to(device)).logits.cpu()


def hybrid_batch(seed: int = 1, b: int = 2, s: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g)
