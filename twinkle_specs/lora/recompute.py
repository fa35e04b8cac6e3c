"""The adapter's A GEMM keeps a recipe for its input, not a copy, where the base keeps the ingredient.

With a frozen base, Transformer Engine saves no GEMM input (there is no weight gradient), so an A GEMM
that saved its own input (the norm's output feeding QKV or fc1, the SwiGLU output feeding fc2) would
keep a whole extra activation per linear: 2.25 GiB on the Qwen3-1.7B shape at 4096 tokens, a third of
the frozen model's activations (bench/results/2026-11-22-h200-profile-before). The module producing
that input keeps what it is computed from (the norm its input, SwiGLU its input), so the A GEMM
(:class:`~twinkle_specs.lora.functions.LowRankDown`) keeps that tensor and the function that recomputes
its input in backward (one norm or activation kernel). An :class:`InputRecipe` links the producer to
the adapted linear that consumes its output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def recompute_allowed() -> bool:
    """Whether nobody else manages saved tensors here: under a non-reentrant checkpoint or activation
    offloading (saved-tensor hooks of their own) the A GEMM saves its input as is and leaves it to
    them, rather than keeping a second tensor alive beside what they drop or offload."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is None


class InputRecipe:
    """Hands an adapted linear a recipe for its input: ``(source, fn)`` with ``fn(source) == input``.

    A forward hook on the producer module records ``source``: its input (a norm, ``from_input``) or its
    output (an MLP's ``linear_fc1``, whose output the activation ``fn`` turns into fc2's input). The
    consumer's :meth:`take` checks on first use that ``fn(source)`` reproduces its input bit for bit
    (the model may apply a different activation, or the norm's output may not be what reaches the
    linear); if not, this link switches itself off and the A GEMM saves its input as before.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], name: str, *, from_input: bool) -> None:
        self.fn, self.name, self.from_input = fn, name, from_input
        self.pending: tuple | None = None  # (source, fn handed over with it, or None)
        self.checked = self.ok = False
        self.widths: tuple[int, int] | None = None  # (source, input) last dims of the checked call

    def put(self, _module: torch.nn.Module, inputs: tuple, output) -> None:
        """The producer's forward hook."""
        source = inputs[0] if self.from_input else output
        self.pending = (source[0] if isinstance(source, tuple) else source, None)

    def hand(self, source: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """For a producer that computes the consumer's input as ``fn(source)`` itself (the same function,
        so bit for bit by construction): the recipe of this one call, taken without a check."""
        self.pending = (source, fn)

    def drop(self) -> None:
        """Forgets what the producer handed over (a consumer whose adapters are merged uses none)."""
        self.pending = None

    def take(self, x: torch.Tensor) -> tuple | None:
        """``(source, fn)`` with ``fn(source) == x``, or None; drops the reference either way."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0].shape[:-1] != x.shape[:-1]:
            return None
        source, handed = pending
        if handed is not None:
            return source, handed
        widths = (source.shape[-1], x.shape[-1])
        if not self.checked:
            self.checked, self.widths = True, widths
            with torch.no_grad():
                self.ok = torch.equal(self.fn(source), x)
            if not self.ok:
                log.warning("%s: the adapter input is not fn(source); it is saved as is", self.name)
        return (source, self.fn) if self.ok and widths == self.widths else None
