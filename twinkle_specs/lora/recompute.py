"""The adapter's A GEMM keeps a recipe for its input, not a copy, where the base keeps the ingredient.

With a frozen base, Transformer Engine saves no GEMM input (there is no weight gradient), so when
autograd saves the adapter's input for A's gradient (``norm(x)`` of a norm-fused QKV or fc1, the SwiGLU
output feeding fc2) that is a whole extra activation per linear: 2.25 GiB on the Qwen3-1.7B shape at
4096 tokens, a third of the frozen model's activations (bench/results/2026-11-22-h200-profile-before).
The base does keep what those inputs are computed from (``x`` for its own norm's gradient, SwiGLU's
input for SwiGLU's), so the GEMM's saved input is swapped, through saved-tensor hooks, for that tensor
and the function that recomputes the input in backward (one norm or activation kernel).

Hooks rather than a custom ``autograd.Function``: everything else stays torch's own C++ autograd (no
Python in the backward but the recompute, no nested backward for the norm). Host time matters, the
micro-batch-1 LoRA step is host-bound: on CPU with tiny tensors (``bench/lora_host.py``) the hooks add
about 65 us per norm-fused linear's forward + backward to the adapter that keeps ``norm(x)``, a custom
function about 95 us.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class _Recipe:
    """What a saved tensor is recomputed from: ``fn(source)`` viewed as the saved tensor was."""

    __slots__ = ("source", "fn", "shape", "stride", "offset")

    def __init__(self, source: torch.Tensor, fn: Callable, saved: torch.Tensor) -> None:
        self.source, self.fn = source, fn
        self.shape, self.stride, self.offset = saved.shape, saved.stride(), saved.storage_offset()

    def tensor(self) -> torch.Tensor:
        with torch.no_grad():
            return self.fn(self.source).as_strided(self.shape, self.stride, self.offset)


def recompute_allowed() -> bool:
    """Whether nobody else manages saved tensors here: a non-reentrant checkpoint or activation
    offloading installs saved-tensor hooks of its own, and inner hooks would hide the GEMM's saves
    from them (a reference kept here would outlive what they drop or offload)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is None


def linear_recomputing_input(
    inp: torch.Tensor, weight: torch.Tensor, source: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``F.linear(inp, weight)`` whose backward recomputes ``inp = fn(source)`` instead of keeping it.

    ``fn(source)`` must reproduce ``inp`` bit for bit (same kernel, same dtype); ``source`` is kept
    alive instead of ``inp``, so this saves memory only where something else keeps ``source`` anyway.
    Any view of ``inp`` that the GEMM saves (``linear`` flattens the token dimensions) is rebuilt as
    the same view of the recomputed tensor.
    """
    storage = inp.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        return _Recipe(source, fn, t) if t.untyped_storage().data_ptr() == storage else t

    def unpack(p):
        return p.tensor() if isinstance(p, _Recipe) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return F.linear(inp, weight)
