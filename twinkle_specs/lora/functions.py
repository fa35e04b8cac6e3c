"""The adapter's custom autograd functions: what its GEMMs save and where their gradients go.

A LoRA linear computes ``base(x) + (s * x @ Aᵀ) @ Bᵀ`` beside a frozen base. Written with plain autograd
ops, each adapted linear would (1) save the A GEMM's input, which the frozen base does not keep, (2)
write the B GEMM's output and add it to the base output, and (3) write the adapter's input gradient
``dh @ A`` and add it to the base's. Each is a full-size activation of memory or of memory traffic per
adapted linear (on the Qwen3-8B shape at 4096 tokens the sums of (3) alone took 1.8 ms of a 83 ms LoRA
step on an H100). These functions avoid all three:

* :class:`LowRankDown`, the A GEMM, keeps a recipe for its input where it is given one (see
  :mod:`.recompute`) and, given a :class:`GradLink`, hands its input gradient to the base's; it applies
  the adapter's scaling as the GEMMs' alpha, not as a multiply of its own each way;
* :class:`IntoBaseGrad` sits on the base linear's input: identity forward; in backward it adds
  ``dh @ A`` into the base's input gradient with one beta = 1 GEMM;
* :class:`AddLowRank`, the B GEMM, accumulates into the base output in place;
* :class:`Gather` assembles the fused B with a one-kernel backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class GradLink:
    """Carries ``dh`` (the gradient of the A GEMM's output), ``A`` and the A GEMM's ``scale`` from
    :class:`LowRankDown`'s backward to :class:`IntoBaseGrad`'s, one per forward of an adapted linear:
    the input gradient to add is ``scale * dh @ A``. A ``deferred`` link goes to the function that
    produced the linear's input instead (an MLP's SwiGLU, :class:`~twinkle_specs.lora.swiglu.SwigluLora`),
    which adds ``scale * dh @ A`` to the input gradient inside its own kernel and computes ``A``'s
    gradient there too."""

    __slots__ = ("dh", "a", "scale", "deferred")

    def __init__(self, deferred: bool = False) -> None:
        self.dh: torch.Tensor | None = None
        self.a: torch.Tensor | None = None
        self.scale = 1.0
        self.deferred = deferred


class IntoBaseGrad(torch.autograd.Function):
    """Identity on the base linear's input; its backward adds the adapter's input gradient ``dh @ A``
    into the base's (the base linear's dgrad) in place, one GEMM with beta = 1.

    Order is guaranteed by the graph: this function's output feeds both the base linear and the A GEMM
    (:class:`LowRankDown`), so autograd runs this backward only after both of theirs; the A GEMM
    returns no input gradient of its own and leaves ``dh`` on the link instead. The incoming gradient is
    therefore the base linear's dgrad alone, a tensor the base made for this backward and hands to
    nobody else. Transformer Engine returns it as a reshape of its 2-D GEMM output
    (``dgrad.view(ctx.inp_shape)``); such a view of a whole tensor is summed into in place too (on the
    Qwen3-8B shape, out of place cost three full-size adds per layer, 0.6 ms of a 75 ms step on an
    H200). Where the gradient is part of a larger tensor, strided, or of another dtype, the sum is out
    of place.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, link: GradLink) -> torch.Tensor:
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        link = ctx.link
        dh, a, scale = link.dh, link.a, link.scale
        link.dh = link.a = None
        if dh is None:  # the adapter's A GEMM took no part in this backward
            return grad, None
        dh = dh.reshape(-1, dh.shape[-1])
        if _whole(grad) and grad.dtype == dh.dtype == a.dtype:
            grad.view(-1, grad.shape[-1]).addmm_(dh, a, alpha=scale)
            return grad, None
        return grad + scaled_mm(dh, a, scale).view(grad.shape).to(grad.dtype), None


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * a @ b`` as one GEMM (the scale is cuBLAS's alpha; beta = 0 leaves the uninitialised
    output unread, as torch documents for ``addmm``), rounded once."""
    if scale == 1.0:
        return a @ b
    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=scale)


def low_rank_down(x: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * x @ aᵀ`` for ``x`` [..., in] and ``a`` [r, in], rounded once: :class:`LowRankDown`'s
    forward, and what a forward without autograd runs, so that evaluation's ``h`` is training's."""
    if scale == 1.0:
        return F.linear(x, a)
    return scaled_mm(x.reshape(-1, x.shape[-1]), a.t(), scale).view(*x.shape[:-1], a.shape[0])


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and all of its storage's tensor: a tensor of its own or a reshape view
    covering all of its base."""
    base = t._base
    return t.is_contiguous() and (
        base is None
        or (base.is_contiguous() and base.numel() == t.numel() and base.data_ptr() == t.data_ptr())
    )


class LowRankDown(torch.autograd.Function):
    """``scale * x @ aᵀ``, the adapter's A GEMM with its scaling as the GEMM's alpha (a multiply of its
    own would be a kernel each way per adapted linear, 64 a step on the Qwen3-8B shape's 8 layers).

    With a recipe (``source``, ``fn``: ``fn(source)`` reproduces ``x`` bit for bit) it keeps ``source``,
    which the base keeps anyway, instead of ``x`` and recomputes ``x`` in backward, or takes ``a``'s
    gradient from ``source`` where ``fn`` has an ``a_grad`` (:class:`~twinkle_specs.lora.norm.RowScaled`).
    With a ``link`` it returns no input gradient and leaves ``dh``, ``a`` and ``scale`` on the link for
    :class:`IntoBaseGrad`; with a deferred one it keeps nothing and returns no gradient at all (``a``'s
    comes from the link's consumer).
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        a: torch.Tensor,
        link: GradLink | None,
        source: torch.Tensor | None,
        fn: Callable[[torch.Tensor], torch.Tensor] | None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        ctx.link, ctx.fn, ctx.scale = link, fn, scale
        if link is not None and link.deferred:
            ctx.save_for_backward()
        else:
            ctx.save_for_backward(x if fn is None else source, a)
        return low_rank_down(x, a, scale)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        link, scale = ctx.link, ctx.scale
        if link is not None and link.deferred:
            link.dh, link.scale = dh, scale
            return None, None, None, None, None, None
        saved, a = ctx.saved_tensors
        dh2 = dh.reshape(-1, dh.shape[-1])
        dx = da = None
        if ctx.needs_input_grad[1]:
            a_grad = getattr(ctx.fn, "a_grad", None)  # a recipe that needs no x for it (norm.RowScaled)
            if a_grad is not None:
                da = a_grad(saved, dh2, scale)
            else:
                x = saved if ctx.fn is None else ctx.fn(saved)
                da = scaled_mm(dh2.t(), x.reshape(-1, x.shape[-1]), scale)
        if link is not None:
            link.dh, link.a, link.scale = dh, a, scale
        elif ctx.needs_input_grad[0]:
            dx = scaled_mm(dh2, a, scale).view(*dh.shape[:-1], a.shape[-1])
        return dx, da, None, None, None, None


class AddLowRank(torch.autograd.Function):
    """``out += h @ bᵀ`` in place, for the base linear's output ``out`` (fresh, saved by nobody).

    ``torch.addmm(out, h, bᵀ)`` first copies ``out`` into its result, a full-size copy per adapted
    linear (3 ms per step of the Qwen3-1.7B shape at 4096 tokens on an H100, of ~115); here the B GEMM
    accumulates into ``out`` itself (cuBLAS beta = 1). ``addmm_`` cannot be called on ``out`` under
    autograd: Transformer Engine returns it as a view made inside its autograd function, which autograd
    forbids modifying in place, hence this function. The gradient of ``out`` passes through unchanged,
    those of ``h`` and ``b`` are ``addmm``'s. Had anything saved ``out`` for its backward, autograd
    would raise its "modified by an inplace operation" error there (the version counter moves): a
    loud failure, never a silently wrong gradient. ``out_grad`` (optional) is what the gradient of
    ``out`` passes through after the adapter's GEMMs took theirs (the FP8 cast of a known amax,
    :class:`~twinkle_specs.lora.fp8_amax.GradAmax`).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, out_grad=None) -> torch.Tensor:
        ctx.save_for_backward(h, b)
        ctx.out_grad = out_grad
        out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.t())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dh = (g @ b).view(h.shape) if ctx.needs_input_grad[1] else None
        db = g.t() @ h.reshape(-1, h.shape[-1]) if ctx.needs_input_grad[2] else None
        return grad if ctx.out_grad is None else ctx.out_grad(grad), dh, db, None


class Gather(torch.autograd.Function):
    """``src[index]`` for an ``index`` that reads every element of ``src`` at most once; the backward is
    the gather by its ``inverse`` (one kernel, deterministic), not the zero-fill and scatter-add of
    ``index_select``'s backward. ``inverse`` points the unread elements one past the end, at a zero
    appended to the gradient (``unread``)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, unread: bool):
        ctx.save_for_backward(inverse)
        ctx.unread = unread
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        if ctx.unread:
            grad = torch.cat([grad, grad.new_zeros(1)])
        return grad.index_select(0, inverse), None, None, None
