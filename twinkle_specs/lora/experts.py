"""Routed experts' GEMMs for LoRA: the frozen base and the per-expert adapters, one grouped GEMM each.

megatron hands a grouped-GEMM expert linear its routed tokens sorted by expert plus the token count of
each local expert (``m_splits``, on the host). Transformer Engine's GroupedLinear runs that as one
cuBLAS GEMM per expert, launched and planned from the host: with 128 experts that was ~4 ms of host
time per call on an H100, 16 calls per step on the 4-layer Qwen3-30B-A3B shape, with the GPU idle
86 % of the LoRA step (a profile on an H100). A LoRA model's expert
weights are frozen, so the base needs no weight gradient and can run as torch's grouped GEMM
(``torch._grouped_mm``: one kernel over all experts, the token blocks' ends on the device) in both
directions, as can the adapters. Where torch's grouped GEMM does not run (not CUDA sm90, not bf16,
unaligned sizes, fp8, a bias, trainable experts) the base stays TE's and the adapters go one expert at
a time.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .grouped_low_rank import grouped_low_rank_add_


def expert_delta_loop(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, splits: list[int], scaling: float
) -> torch.Tensor:
    """Routed-expert adapter delta, one expert at a time: ``scaling * B_e(A_e(x_e))`` for each expert's
    token block ``x_e`` (``splits``), two GEMMs and a multiply per expert. The exact math of the
    reference; used where :func:`expert_delta_grouped` cannot run."""
    parts = torch.split(x, splits)
    return torch.cat([F.linear(F.linear(xe, a[e]), b[e]) * scaling for e, xe in enumerate(parts)])


def expert_delta_grouped(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    splits: list[int] | DeviceCounts,
    scaling: float,
    ends: torch.Tensor | None = None,
    recipe: tuple | None = None,
) -> torch.Tensor:
    """The same delta with two grouped GEMMs for all experts (``torch._grouped_mm``, offsets = the
    token blocks' ends, :func:`group_ends`; an expert without tokens is an empty group and gets zero
    gradients) and one ``scaling`` multiply of the rank-r activation. With a ``recipe`` ``(source,
    fn)``, ``fn(source) == x``, the A GEMM keeps ``source`` instead of ``x`` (:class:`GroupedLowRankDown`).

    Why this and not a padded ``bmm``: the grouped GEMM reads the routed tokens where they are, while a
    padded bmm copies every block into an [experts, max tokens, hidden] buffer (and back), sized by the
    busiest expert, which is several times the routed tokens when routing is uneven, and needs the
    largest block on the host. Rows past the last offset would be left unwritten by ``_grouped_mm``;
    there are none, the offsets end at ``x.shape[0]``.
    """
    offs = group_ends(splits, x.device) if ends is None else ends
    h = GroupedLowRankDown.apply(x, a, offs, *(recipe or (None, None)))
    if scaling != 1.0:
        h = h * scaling
    return torch._grouped_mm(h, b.transpose(-2, -1), offs=offs)


class GroupedLowRankDown(torch.autograd.Function):
    """``x_e @ A_eᵀ`` for every expert's token block: the routed adapters' A GEMM, one grouped GEMM.

    Its backward forms the products autograd forms for ``torch._grouped_mm`` (the input gradient
    ``dh_e @ A_e``, the factor's ``dh_eᵀ @ x_e``), so the gradients are those of the plain op; what
    differs is what it keeps. ``x`` (all routed tokens, [tokens × top-k, hidden] for an expert fc1) is
    the largest tensor an adapted expert would save, and the frozen base keeps none of it. Given a
    recipe (``source``, ``fn``: ``fn(source)`` reproduces ``x`` bit for bit, e.g. the MoE layer's input
    gathered in routing order, :class:`~twinkle_specs.lora.recompute.RoutedTokens`) it keeps ``source``
    and rebuilds ``x`` in backward.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        a: torch.Tensor,
        ends: torch.Tensor,
        source: torch.Tensor | None,
        fn: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x if fn is None else source, a, ends)
        return torch._grouped_mm(x, a.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        saved, a, ends = ctx.saved_tensors
        dh = dh.contiguous()
        dx = da = None
        if ctx.needs_input_grad[1]:
            x = saved if ctx.fn is None else ctx.fn(saved)
            da = torch._grouped_mm(dh.t(), x, offs=ends)
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dh, a, offs=ends)
        return dx, da, None, None, None


class FrozenGroupedMM(torch.autograd.Function):
    """``x_e @ W_eᵀ`` for every expert's token block, one grouped GEMM, with frozen ``w`` [experts, out,
    in]: the backward is the input gradient alone (one grouped GEMM with ``w`` as it is), and only the
    weights and offsets are kept for it, never the routed tokens (as TE's GroupedLinear keeps nothing
    but its weights when they are frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, ends)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w, ends = ctx.saved_tensors
        return torch._grouped_mm(grad.contiguous(), w, offs=ends), None, None


class FrozenGroupedLora(torch.autograd.Function):
    """``x_e @ W_eᵀ + (scaling * x_e @ A_eᵀ) @ B_eᵀ`` for every expert's token block: a frozen grouped
    base and its routed adapters as one function, so that the adapter's rank-r products go into the
    base's output and into its input gradient in place (:func:`.grouped_low_rank.grouped_low_rank_add_`)
    instead of being written full size and summed by a kernel each.

    The gradients are those autograd forms for :class:`FrozenGroupedMM` plus
    :func:`expert_delta_grouped`, with the same roundings of the rank-r activations (``h`` scaled, then
    rounded; the gradient of ``h`` likewise); each full-size sum is rounded once instead of twice. It
    keeps the weight stack, the factors, the rank-r ``h`` and the routed tokens (or, given a recipe
    ``(source, fn)`` with ``fn(source) == x``, ``source``; see :class:`GroupedLowRankDown`), which only
    ``A``'s gradient reads.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        w: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        ends: torch.Tensor,
        scaling: float,
        source: torch.Tensor | None,
        fn: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
        h = torch._grouped_mm(x, a.transpose(-2, -1), offs=ends)
        if scaling != 1.0:
            h = h * scaling
        grouped_low_rank_add_(out, h, b.transpose(-2, -1), ends)
        ctx.fn, ctx.scaling = fn, scaling
        ctx.save_for_backward(x if fn is None else source, w, a, b, h, ends)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, w, a, b, h, ends = ctx.saved_tensors
        grad = grad.contiguous()
        need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
        dx = da = db = None
        if need_b:
            db = torch._grouped_mm(grad.t(), h, offs=ends)
        if need_x or need_a:
            dh = torch._grouped_mm(grad, b, offs=ends)
            if ctx.scaling != 1.0:
                dh = dh * ctx.scaling
            if need_a:
                x = saved if ctx.fn is None else ctx.fn(saved)
                da = torch._grouped_mm(dh.t(), x, offs=ends)
            if need_x:
                dx = torch._grouped_mm(grad, w, offs=ends)
                grouped_low_rank_add_(dx, dh, a, ends)
        return dx, None, da, db, None, None, None, None


class DeviceCounts:
    """The routed experts' token counts left on the GPU, as megatron's ``TEGroupedMLP`` hands them to its
    linears (``m_splits``) when the dispatcher did not copy them to the host
    (``patches/moe_counts_on_device.py``): without that copy the host never waits for the router, so
    the GPU never waits for the host's next launches at a MoE layer.

    ``TEGroupedMLP.forward`` first calls ``tolist()``, which returns this object. The grouped GEMMs take
    their offsets on the device (:meth:`ends`, once for fc1 and fc2); a path that needs the sizes on the
    host (TE's GroupedLinear, the per-expert loop) gets :meth:`host`, which waits for them. The counts sum
    to the routed tokens' count by construction (the dispatcher leaves them on the GPU only for a dropless
    dispatch, whose output size is static)."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts
        self._ends: torch.Tensor | None = None
        self._host: list[int] | None = None

    def tolist(self) -> DeviceCounts:
        return self

    def ends(self) -> torch.Tensor:
        """The token blocks' ends (int32, on the counts' device), computed there once."""
        if self._ends is None:
            self._ends = torch.cumsum(self.counts, 0, dtype=torch.int32)
        return self._ends

    def host(self) -> list[int]:
        """The counts as a host list (a host sync, once)."""
        if self._host is None:
            self._host = self.counts.tolist()
        return self._host


def on_host(splits: list[int] | DeviceCounts) -> list[int]:
    """``splits`` as a host list (waiting for :class:`DeviceCounts`)."""
    return splits.host() if isinstance(splits, DeviceCounts) else splits


def grouped_mm_fits(x: torch.Tensor, splits: list[int] | DeviceCounts, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs here for ``x`` against each of ``weights`` ([experts, rows,
    cols] each): CUDA sm90, bf16, every row stride a multiple of 16 bytes, a 2-D token block of at
    least one token that ``splits`` covers. Blackwell is left out: its grouped GEMM gave non-zero
    gradients for zero-token experts (pytorch#172439)."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.dim() != 2 or not x.shape[0]:
        return False
    covered = isinstance(splits, DeviceCounts) or sum(splits) == x.shape[0]  # DeviceCounts: by construction
    if x.dtype != torch.bfloat16 or any(w.dtype != x.dtype for w in weights) or not covered:
        return False
    if _device_capability(x.device)[0] != 9 or x.stride(-1) != 1 or x.stride(0) % 8:
        return False
    return all(n % 8 == 0 for w in weights for n in w.shape[-2:])


@functools.cache
def _device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


_LAST_ENDS: list = []  # [(splits, device, ends)]: the most recent, see group_ends


def group_ends(splits: list[int] | DeviceCounts, device: torch.device) -> torch.Tensor:
    """The token blocks' ends (int32, on ``device``) for ``splits`` (:meth:`DeviceCounts.ends` for counts
    on the device). One host-to-device copy per MoE layer forward, not per GEMM: an expert MLP's fc1 and
    fc2 (and their adapters) get equal splits, so the last answer is kept and reused when the splits are
    equal (compared by value).

    The copy to a GPU goes from pinned memory without blocking: from pageable memory CUDA first waits for
    everything queued on the stream, so the host would stop at every MoE layer until the GPU is idle, and
    the GPU would then wait for the host's next launches. torch's pinned-memory cache keeps the source
    until the copy has run. Not while a CUDA graph is being captured (a captured copy would read the
    pinned buffer again at every replay): there the plain copy, which capture refuses, as before."""
    if isinstance(splits, DeviceCounts):
        return splits.ends()
    if _LAST_ENDS:
        last_splits, last_device, ends = _LAST_ENDS[0]
        if last_device == device and last_splits == splits:
            return ends
    host = torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32)
    if torch.device(device).type == "cuda" and not torch.cuda.is_current_stream_capturing():
        ends = host.pin_memory().to(device, non_blocking=True)
    else:
        ends = host.to(device)
    _LAST_ENDS[:] = [(list(splits), device, ends)]
    return ends


class StackedWeights:
    """A grouped linear's per-expert weights (``weight0`` … ``weightN``, the parameters that loading,
    checkpoints and export see) kept as views of one [experts, out, in] tensor, which is what the
    grouped GEMM reads.

    The parameters stay the module's own, under their names; only their storage moves, once. Anything
    that later gives a weight new storage (``.cuda()`` or a dtype cast of CPU-initialised weights,
    assigning ``.data``) is noticed at the next :meth:`get` by comparing storage addresses, and the
    stack is rebuilt from the weights' current values, so the GEMM never reads stale weights.
    """

    def __init__(self) -> None:
        self._stack: torch.Tensor | None = None
        self._addresses: list[int] = []

    def get(self, weights: list[torch.nn.Parameter]) -> torch.Tensor:
        """The [experts, out, in] tensor whose slices the ``weights`` are, rebuilt if they no longer are."""
        if self._stack is None or [w.data_ptr() for w in weights] != self._addresses:
            stack = torch.stack([w.detach() for w in weights])
            for w, view in zip(weights, stack, strict=True):
                w.data = view
            self._stack, self._addresses = stack, [w.data_ptr() for w in weights]
        return self._stack
