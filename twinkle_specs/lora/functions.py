"""The adapter's two autograd functions: two autograd nodes per LoRA linear instead of about ten, and
no saved copy of an input that the frozen base layer does not save itself.

Why: with a frozen base, Transformer Engine saves no GEMM input (there is no weight gradient), so an
adapter that autograd saves ``norm(x)`` for (the norm-fused QKV and fc1) or the SwiGLU output for
(fc2) adds a full hidden-size or FFN-size activation per linear: on the Qwen3-1.7B shape that was
2.25 GiB at sequence 4096, a third of the frozen model's activations. And the adapter's small ops are
host-launch bound: every autograd node and kernel launch counts.

* :func:`lora_down`: ``h = scale * (input @ A^T)`` for the slots' stacked A. What it saves is a tensor
  the base saves anyway: the pre-norm ``x`` of a norm-fused linear (the norm is recomputed in
  backward; TE keeps ``x`` for its own norm gradient), or the pre-activation that SwiGLU keeps (the
  activation is recomputed), else the input itself.
* :func:`lora_up`: ``out + h @ B^T`` as one ``addmm`` (one rounding instead of two); ``out``'s gradient
  passes through untouched, and B's gradient goes back to the slots' factors through the inverse of
  the fused-B gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Scale = float | torch.Tensor  # one scaling, or one per rank-r column (slots with different scalings)


def _scaled(h: torch.Tensor, scale: Scale) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):  # per-column fp32 scalings, rounded once like a Python scalar
        return (h.float() * scale).to(h.dtype)
    return h if scale == 1.0 else h * scale


def _tokens(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _LoraDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, source, recompute, through, scale, *a_slots):
        a = a_slots[0] if len(a_slots) == 1 else torch.cat(a_slots)
        inp = recompute(x) if through else x
        h = _scaled(F.linear(inp, a), scale)
        ctx.recompute, ctx.through, ctx.scale = recompute, through, scale
        ctx.ranks = [t.shape[0] for t in a_slots]
        ctx.save_for_backward(source, a)
        return h

    @staticmethod
    def backward(ctx, dh):
        source, a = ctx.saved_tensors
        dh = _scaled(dh, ctx.scale)
        want_x = ctx.needs_input_grad[0]
        if ctx.through:  # the adapter input is recompute(x): rebuild it with its graph to x
            with torch.enable_grad():
                xr = source.detach().requires_grad_(want_x)
                inp = ctx.recompute(xr)
        elif ctx.recompute is not None:  # x's value rebuilt from what the base saved
            with torch.no_grad():
                inp = ctx.recompute(source)
        else:
            inp = source
        da = _tokens(dh).t().mm(_tokens(inp))
        dx = None
        if want_x:
            dx = dh.matmul(a)
            if ctx.through:
                (dx,) = torch.autograd.grad(inp, xr, dx)
        da_slots = da.split(ctx.ranks) if len(ctx.ranks) > 1 else (da,)
        return (dx, None, None, None, None, *da_slots)


def lora_down(
    x: torch.Tensor,
    a_slots: list[torch.Tensor],
    scale: Scale,
    *,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    activation: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``scale * (input @ [A_1; A_2; ...]^T)``, the rank-r activation of all slots.

    ``input`` is ``norm(x)`` when ``norm`` is given (``x`` is saved, the norm recomputed in backward;
    its weight must not need a gradient, none is returned for it), or ``x`` itself; ``activation`` =
    ``(pre, fn)`` says that ``x == fn(pre)`` bit for bit and ``pre`` is kept alive anyway, so ``pre``
    is saved instead of ``x`` and ``x`` recomputed from it.
    """
    if norm is not None:
        return _LoraDown.apply(x, x, norm, True, scale, *a_slots)
    if activation is not None:
        pre, fn = activation
        return _LoraDown.apply(x, pre, fn, False, scale, *a_slots)
    return _LoraDown.apply(x, x, None, False, scale, *a_slots)


class _LoraUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, h, layout, *b_slots):
        b = b_slots[0] if layout is None else fused_b(b_slots, layout)
        y = torch.addmm(_tokens(out), _tokens(h), b.t()).view(out.shape)
        ctx.layout, ctx.shapes = layout, [t.shape for t in b_slots]
        ctx.save_for_backward(h, b)
        return y

    @staticmethod
    def backward(ctx, dy):
        h, b = ctx.saved_tensors
        dh = dy.matmul(b) if ctx.needs_input_grad[1] else None
        db = _tokens(dy).t().mm(_tokens(h))
        if ctx.layout is None:
            db_slots = (db,)
        else:
            flat = db.reshape(-1).index_select(0, ctx.layout.inverse)
            sizes = [s.numel() for s in ctx.shapes]
            parts = flat[: sum(sizes)].split(sizes)
            db_slots = tuple(p.view(s) for p, s in zip(parts, ctx.shapes, strict=True))
        return (dy, dh, None, *db_slots)


def fused_b(b_slots: tuple[torch.Tensor, ...] | list[torch.Tensor], layout: Any) -> torch.Tensor:
    """The block-structured B of several slots (see ``LoraLayerMixin.lora_B_fused``), without a graph:
    one gather of a cached permutation over [every B, flattened; a block of zeros]."""
    b = b_slots[0]
    flat = torch.cat([*(t.reshape(-1) for t in b_slots), zeros(layout.zeros, b.dtype, b.device)])
    return flat.index_select(0, layout.index).view(layout.rows, layout.cols)


@functools.cache
def zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant block of ``n`` zeros (never written: it only feeds the fused-B gather)."""
    return torch.zeros(n, dtype=dtype, device=device)


def lora_up(out: torch.Tensor, h: torch.Tensor, b_slots: list[torch.Tensor], layout: Any) -> torch.Tensor:
    """``out + h @ B^T`` with B fused from ``b_slots`` by ``layout`` (None: one slot, B itself)."""
    return _LoraUp.apply(out, h, layout, *b_slots)
