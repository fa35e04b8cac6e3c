"""The HF checkpoint of a shape: written once with random weights, then read into Megatron while timed
(variant (b) on one rank here; bench/load.py on several ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from .device import GiB, device, sync


def make_checkpoint(hf_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Random weights for the config in ``hf_dir``, saved as safetensors (bf16 as the config says)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(hf_dir)
    t0 = time.perf_counter()
    with device():
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(config, "dtype", None) or torch.float32
        )
    model.save_pretrained(hf_dir)
    del model
    files = sorted(hf_dir.glob("*.safetensors"))
    return {"seconds": time.perf_counter() - t0, "bytes": sum(f.stat().st_size for f in files)}


def drop_page_cache(files: list[Path]) -> bool:
    """Asks the kernel to forget the checkpoint's cached pages (no root needed for clean pages)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


def time_load(model, hf_dir: Path) -> dict[str, Any]:
    """HF safetensors -> Megatron parameters on this rank: seconds and bytes read vs checkpoint size.

    The model gets its own initial weights back afterwards, so (b) trains on the same kind of weights as (a)
    (megatron's initialisation), not on the checkpoint's: GEMM speed depends a little on the values (power),
    and (b)/(a) is to measure the spec alone."""
    from twinkle_specs.loading import load_hf_weights

    initial = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    dropped = drop_page_cache(sorted(hf_dir.glob("*.safetensors")))
    sync()
    t0 = time.perf_counter()
    report = load_hf_weights(model, hf_dir)
    sync()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial.pop(name))
    return {
        "seconds": seconds,
        "bytes_read": report.bytes_read,
        "checkpoint_bytes": report.checkpoint_bytes,
        "read_fraction": report.bytes_read / report.checkpoint_bytes if report.checkpoint_bytes else None,
        "gib_per_s": report.bytes_read / GiB / seconds if seconds else None,
        "parameters": report.parameters,
        "page_cache_dropped": dropped,
        "ranks": 1,
    }
