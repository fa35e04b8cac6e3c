"""GPU memory of a variant: the peak over its timed steps, what one forward keeps for its backward, and
handing the cache back between variants. Nothing is measured on CPU."""

from __future__ import annotations

import contextlib
import gc

import torch

from .device import GiB, on_gpu, sync


def reset_peak() -> float | None:
    """Starts a peak measurement; returns what is allocated now (None on CPU)."""
    if not on_gpu():
        return None
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak(before: float | None, one_variant: bool) -> dict[str, float]:
    """The peak since :func:`reset_peak` (which returned ``before``). With several variants resident and
    stepped in turn the step's own share is the largest of all their steps, no one variant's: left out."""
    if before is None:
        return {}
    top = torch.cuda.max_memory_allocated()
    out = {
        "peak_memory_gib": top / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
        "memory_before_step_gib": before / GiB,
    }
    if one_variant:
        out["step_memory_gib"] = (top - before) / GiB
    return out


def activation_memory(forward, finish) -> dict[str, float]:
    """What one forward leaves allocated for its backward (the saved activations, plus the loss): the
    LoRA-vs-frozen memory comparison without the weights, optimizer state and transient peaks. Runs a
    whole step (``finish(forward())``) so that the model's state stays as training leaves it."""
    if not on_gpu():
        return {}
    sync()
    before = torch.cuda.memory_allocated()
    loss = forward()
    sync()
    held = torch.cuda.memory_allocated() - before
    finish(loss)
    sync()
    return {"activation_memory_gib": held / GiB}


def release() -> None:
    """Frees what a finished variant left (Python cycles, the CUDA cache) before the next one builds."""
    with contextlib.suppress(Exception):
        gc.collect()
        if on_gpu():
            torch.cuda.empty_cache()
