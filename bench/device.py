"""The device a variant runs on: one CUDA GPU when there is one, else the CPU (the portable path)."""

from __future__ import annotations

import torch

GiB = 2**30


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def sync() -> None:
    """Waits for the GPU's queued work (nothing to wait for on CPU)."""
    if on_gpu():
        torch.cuda.synchronize()
