"""Tiny random Qwen checkpoints built with transformers from configs (no downloads)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
_MOE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
)

# kind -> (transformers config class, its fields beyond _COMMON)
_KINDS = {
    # Qwen2 (always QKV bias), GQA, tied embeddings.
    "qwen2": (Qwen2Config, dict(intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen2.5-style: QKV bias, untied, rope_theta 1e6, MHA.
    "qwen2_5": (
        Qwen2Config,
        dict(intermediate_size=96, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1e6),
    ),
    # Qwen3: head_dim != hidden/heads, GQA, q/k norm, untied.
    "qwen3": (
        Qwen3Config,
        dict(intermediate_size=96, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
    ),
    "qwen3_moe": (Qwen3MoeConfig, _MOE | dict(head_dim=16, norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen3_moe_nonorm": (
        Qwen3MoeConfig,
        _MOE | dict(head_dim=16, norm_topk_prob=False, tie_word_embeddings=True),
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        _MOE | dict(shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False),
    ),
}
# YaRN: a short original context (32) so that YARN_SEQ tokens run well past it.
YARN_SEQ = 96
_YARN = dict(rope_type="yarn", original_max_position_embeddings=32)
_KINDS |= {
    # transformers' default attention factor 0.1 ln(factor) + 1.
    "qwen3_yarn": (
        Qwen3Config,
        _KINDS["qwen3"][1]
        | dict(max_position_embeddings=128, rope_parameters=_YARN | dict(factor=4.0, rope_theta=10000.0)),
    ),
    # Explicit attention_factor and correction-range betas, rope_theta 1e6.
    "qwen2_yarn": (
        Qwen2Config,
        _KINDS["qwen2"][1]
        | dict(
            max_position_embeddings=96,
            rope_parameters=_YARN
            | dict(factor=3.0, attention_factor=1.25, beta_fast=16.0, beta_slow=2.0, rope_theta=1e6),
        ),
    ),
    # factor null (-> max_position_embeddings / original), mscale/mscale_all_dim, no rounding of the range.
    "qwen3_yarn_mscale": (
        Qwen3Config,
        _KINDS["qwen3"][1]
        | dict(
            rope_parameters=_YARN
            | dict(factor=None, mscale=1.2, mscale_all_dim=0.8, truncate=False, rope_theta=10000.0)
        ),
    ),
    "qwen3_moe_yarn": (
        Qwen3MoeConfig,
        _KINDS["qwen3_moe"][1]
        | dict(max_position_embeddings=128, rope_parameters=_YARN | dict(factor=4.0, rope_theta=10000.0)),
    ),
}


def qwen_config(kind: str, **overrides):
    """The tiny transformers config of ``kind``; ``overrides`` replace any field (vocab, layers, ...)."""
    cls, fields = _KINDS[kind]
    return cls(**copy.deepcopy(_COMMON | fields | overrides))  # transformers edits rope_parameters in place


CONFIGS = {kind: (lambda kind=kind: qwen_config(kind)) for kind in _KINDS}


def make_checkpoint(
    kind: str, out: Path, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Saves a random tiny model of ``kind`` (config fields overridable) as safetensors in ``out``;
    weights are scaled up from the default init so that errors in any tensor show clearly in the logits."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen_config(kind, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not all-ones, so a norm loaded in the wrong place shows
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


SAFE = "model.safetensors"  # the single shard make_checkpoint writes without max_shard_size


def rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    """A copy of the single-shard checkpoint ``src`` at ``dst`` whose tensors ``edit`` (a callable on the
    name -> tensor dict) has changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / SAFE)
    edit(tensors)
    save_file(tensors, dst / SAFE, metadata={"format": "pt"})
    return dst


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def batch(seed: int = 1, b: int = 2, s: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g)
