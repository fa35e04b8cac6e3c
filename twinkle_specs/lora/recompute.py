"""The adapter's A GEMM keeps a recipe for its input, not a copy, where the base keeps the ingredient.

With a frozen base, Transformer Engine saves no GEMM input (there is no weight gradient), so an A GEMM
that saved its own input (the norm's output feeding QKV or fc1, the SwiGLU output feeding fc2) would
keep a whole extra activation per linear: 2.25 GiB on the Qwen3-1.7B shape at 4096 tokens, a third of
the frozen model's activations (measured on an H200). The module producing
that input keeps what it is computed from (the norm its input, SwiGLU its input), so the A GEMM
(:class:`~twinkle_specs.lora.functions.LowRankDown`) keeps that tensor and the function that recomputes
its input in backward (one norm or activation kernel). An :class:`InputRecipe` links the producer to
the adapted linear that consumes its output.
"""

from __future__ import annotations

import functools
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
        if not self.ok or widths != self.widths:
            return None
        bind = getattr(self.fn, "bind", None)  # a recipe that uses what this forward left on x
        return source, bind(x) if bind is not None else self.fn


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source``'s rows at ``index``: the routed experts' fc1 input rebuilt from the MoE layer's input."""
    return source.index_select(0, index)


class RoutedTokens:
    """A recipe for the routed experts' fc1 input: the MoE layer's input, gathered in routing order.

    megatron's dispatcher permutes the MoE layer's input so that each expert's tokens are contiguous,
    experts in order and tokens ascending within an expert (``moe_utils.permute``, fused or not): with
    expert parallelism and expert tensor parallelism off, the experts' input is the router's input
    ``h`` [tokens, hidden] at ``index``, the token number of each (expert, token) pair of the routing
    map taken expert-major. That input is top-k times larger than ``h`` ([32768, 2048] against [4096,
    2048] per layer on the Qwen3-30B-A3B shape) and ``h`` is kept anyway (the router's GEMM saves it),
    so fc1's adapter keeps ``h`` and ``index`` and gathers its input again in backward.

    A forward hook on the router (:meth:`put`) records ``h`` and the routing map; fc1's adapter
    :meth:`take`s them in the same layer's forward (``nonzero_static`` with fc1's row count, so no
    host sync). The first use checks bit for bit that the gather reproduces fc1's input (a dispatcher
    that orders or pads tokens otherwise fails it); if not, this recipe switches itself off and the
    adapter saves its input as before.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (router input, routing map)
        self.checked = self.ok = False

    def put(self, _router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        """The router's forward hook: ``router(h) -> (probs, routing_map)``."""
        self.pending = (inputs[0], output[1])

    def drop(self) -> None:
        """Forgets the router's record (an adapter that does not run takes none)."""
        self.pending = None

    def take(self, x: torch.Tensor) -> tuple | None:
        """``(source, fn)`` with ``fn(source) == x`` for fc1's input ``x``, or None; drops the record."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        hidden, routing_map = pending
        source = hidden.reshape(-1, hidden.shape[-1])
        if routing_map.dim() != 2 or routing_map.shape[0] != source.shape[0] or x.dim() != 2:
            return None
        if source.shape[-1] != x.shape[-1] or source.dtype != x.dtype or not x.shape[0]:
            return None
        index = torch.nonzero_static(routing_map.t(), size=x.shape[0])[:, 1].contiguous()
        fn = functools.partial(gather_rows, index=index)
        if not self.checked:
            self.checked = True
            with torch.no_grad():
                self.ok = torch.equal(fn(source), x)
            if not self.ok:
                log.warning(
                    "%s: the experts' input is not the router's input in routing order; it is saved as is",
                    self.name,
                )
        return (source, fn) if self.ok else None
