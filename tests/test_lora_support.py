"""Shared helpers of the LoRA tests (no tests here): tiny random Qwen checkpoints, PEFT references,
megatron parallel state for in-process tests and a gloo launcher for multi-rank workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def hf_config(kind: str):
    """Tiny configs covering GQA + q/k norm (qwen3), QKV bias + tied embeddings (qwen2) and MoE;
    ``qwen3_4l`` has 4 layers, enough for 2 pipeline stages of 2 virtual chunks."""
    from transformers import Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    return {
        "qwen3": lambda: Qwen3Config(
            **_COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False
        ),
        "qwen3_4l": lambda: Qwen3Config(
            **(_COMMON | {"num_hidden_layers": 4}),
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
        ),
        "qwen2": lambda: Qwen2Config(
            **_COMMON, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True
        ),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        "qwen2_moe": lambda: Qwen2MoeConfig(
            **_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    }[kind]()


def make_checkpoint(kind: str, out: Path, seed: int = 0) -> Path:
    """A random tiny HF checkpoint (weights scaled up so every tensor shows in the logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08 if p.dim() >= 2 else 0.05)
    model.save_pretrained(out)
    return out


def hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def randomize_peft(model, seed: int = 3, std: float = 0.1) -> None:
    """Non-zero A and B in a peft model, so the adapter changes every adapted output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def randomize_megatron(model, seed: int = 3, std: float = 0.1) -> None:
    """Non-zero factors in a Megatron LoRA model; the same seed on every rank keeps replicas equal."""
    from twinkle_specs.lora.peft_io import factors

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for f in factors(model):
            full = torch.randn(f.tensor.shape, generator=g) * std
            f.tensor.copy_(full)


def tokens(seed: int = 1, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, toks: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(toks.shape[1]).expand_as(toks)
    with torch.no_grad():
        return model(toks, pos, None)[..., :VOCAB]


@pytest.fixture(scope="module")
def single_rank():
    """megatron parallel state at world size 1 (gloo), for in-process tests."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()


def run_ranks(nproc: int, script: Path, *args: str, timeout: int = 240) -> str:
    """Runs ``script`` on ``nproc`` gloo CPU ranks with torchrun; raises with its output on failure."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "--master-addr=127.0.0.1",
        str(script),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout
