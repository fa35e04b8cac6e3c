"""What the GPU tests share: the tolerances of the Transformer Engine path against transformers, and
the recorder that writes measured numbers to $TWINKLE_EVIDENCE_DIR (committed under docs/evidence/)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import torch

# fp32: TE's GEMMs and fused RMSNorm/RoPE/attention kernels (TF32 tensor-core math) vs transformers'
# eager fp32 ops; measured on H200: max |Δ| 3.4e-3, mean |Δ| 5e-4, cosine 0.9999995 (Qwen2, 128 tokens).
FP32_MAX_ABS = 1e-2
# MoE: a token whose top-k experts are near-tied can route differently under TF32 (measured once on
# Qwen2-MoE: max |Δ| 0.13 at one position, mean |Δ| 6e-4), so the max is bounded more loosely there.
FP32_MOE_MAX_ABS = 0.25
# The hybrid models, fp32 on an H100, both models on CUDA with fla's Triton kernels for the gated delta rule
# (2026-11-25): max |Δ| 1.17e-2 (Qwen3-Next) and 1.28e-2 (Qwen3.5), mean 8.8e-4 to 1.3e-3.
HYBRID_FP32_MAX_ABS = 3e-2
FP32_MEAN_ABS = 1e-3
FP32_MIN_COSINE = 0.99999
BF16_MIN_COSINE = 0.999
# bf16 rounds at different points on each side, so both are judged against the fp32 truth: ours must be
# as close to it as the reference library's own bf16 run is (mean |Δ| within 1.5x).
BF16_ERROR_RATIO = 1.5


def count_calls(monkeypatch, module, name: str) -> list:
    """``module.name`` still called, each call recorded: the returned list grows by one per call."""
    calls: list = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


class Evidence:
    """Measured values by name, merged into ``$TWINKLE_EVIDENCE_DIR/<filename>`` after each record (under a
    lock: several pytest processes may record into one evidence folder at once)."""

    def __init__(self, filename: str) -> None:
        self.filename = filename

    def record(self, name: str, **values) -> None:
        out = os.environ.get("TWINKLE_EVIDENCE_DIR")
        if not out:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out, self.filename)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps(merged | {name: values}, indent=2))


def fp32_max_abs(kind: str) -> float:
    """The max |Δ| bound of a model's fp32 logits on a GPU against transformers' fp32 ones: MoE models' near-tied
    routers take the looser one."""
    return FP32_MOE_MAX_ABS if "moe" in kind else FP32_MAX_ABS


def fp32_router(kind: str, dtype: torch.dtype) -> dict:
    """fp32 runs of MoE models compute the router in fp64. From core_v0.19 megatron-core's router GEMM
    goes through TE's general_gemm (TF32 for fp32 inputs), and a near-tied top-k then routes a token
    differently from transformers' exact fp32 GEMM (measured on H200: max |Δ| 0.80, mean 4.0e-3 with
    the default, 3.7e-3 / 5.3e-4 with fp64; scripts/gpu/diagnose_moe_parity.py). fp64 takes torch's GEMM."""
    return {"moe_router_dtype": "fp64"} if "moe" in kind and dtype == torch.float32 else {}


def fp8_available() -> bool:
    """A CUDA GPU on which Transformer Engine runs FP8 GEMMs (compute capability 8.9+)."""
    if not torch.cuda.is_available():
        return False
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:
        return False
    return FP8GlobalStateManager.is_fp8_available()[0]
