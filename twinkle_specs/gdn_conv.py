"""The Gated DeltaNet's short convolution and its SiLU, channel-last, one Triton kernel forward, two backward.

Each channel of the layer's [q; k; v] is mixed over its last ``K`` tokens (``K`` = 4), then SiLU'd: what
causal-conv1d's ``causal_conv1d_fn(..., activation="silu")`` computes. Where causal-conv1d is not installed
(PyPI has it as a source package only, built against one torch and CUDA), torch's depthwise ``conv1d`` wants
[b, channels, s]: the in_proj output [b, s, x] is transposed into a copy, convolved by torch's generic
depthwise kernel, activated by another kernel, and read back through a transposed view, and the backward
repeats it all. At the Qwen3.5-9B shape (8,192 channels, 4,096 tokens) that was about 1.3 ms of each Gated
DeltaNet layer's forward and backward on an H100. Here the forward reads in_proj's output where it lies (any
row stride, channels contiguous) and writes silu(conv) [b, s, channels]; the backward recomputes the
pre-activation from the input (nothing else is saved), writes SiLU's gradient once and turns it into the
input gradient, with the weight gradient summed from per-block partials (no atomics: the same result on
every run). :func:`split_conv_silu` takes the whole in_proj output: q, k and v come out convolved, each
contiguous, z, beta and alpha as views, and the backward writes all their gradients into one gradient of
in_proj's output (what a split, a convolution and autograd's concatenations did in several copies).

Packed rows (``starts``: int32 [s], each token's sequence start; micro-batch 1) stop every tap at its
sequence's first token, as that sequence alone would see zeros before it.

Rounding: products summed in fp32, SiLU in fp32, the output rounded once to the input dtype; SiLU's
gradient rounded to the input dtype before the input-gradient pass (as autograd of the bf16 torch path
hands it on), the weight gradient accumulated from the fp32 value.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU tensors and machines without Triton
    triton = None

# fixed launch configurations (autotuning would have to finish before CUDA-graph capture): token block,
# channel block, warps
BLOCKS = (32, 128, 4)


def usable(x: torch.Tensor, weight: torch.Tensor, activation: str) -> bool:
    """Whether :func:`conv_silu` runs its kernels for ``x`` [b, s, c] (a CUDA half-precision tensor with
    contiguous channels) and ``weight`` [c, K]."""
    return (
        triton is not None
        and activation == "silu"
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and weight.dtype == x.dtype
    )


def conv_silu(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) of ``x`` [b, s, c] with ``weight`` [c, K] -> [b, s, c] (contiguous),
    differentiable in both; ``starts`` (int32 [s], b = 1) restarts it at each packed sequence."""
    return split_conv_silu(x, weight, (x.shape[-1],), starts)[0]


def split_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, sections: tuple[int, ...], starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """``x`` [b, s, sum(sections)] (the Gated DeltaNet's in_proj output) split along its channels by
    ``sections``: the leading sections that ``weight`` [c, K] covers (their widths add up to c) come back
    convolved and SiLU'd, each a contiguous [b, s, width] (fla's rule takes them without a copy); the others
    as views of ``x``. The backward writes every section's gradient into one gradient of ``x``'s layout
    (the convolved ones by the input-gradient kernel, in place), where a split and a separate convolution
    would concatenate them. ``starts`` (int32 [s], b = 1) restarts the convolution at each packed sequence."""
    if starts is not None and x.shape[0] != 1:
        raise ValueError(f"packed sequences (starts) come as one row, b = 1, not {x.shape[0]}")
    if sum(sections) != x.shape[-1]:
        raise ValueError(f"sections {tuple(sections)} do not add up to the {x.shape[-1]} channels")
    return _SplitConvSilu.apply(x, weight, starts, tuple(sections))


def _bounds(sections: tuple[int, ...], convolved: int) -> tuple[list[tuple[int, int]], int]:
    """Each section's [first, end) channel, and how many leading sections the weight's ``convolved``
    channels cover."""
    ends = [sum(sections[: i + 1]) for i in range(len(sections))]
    if convolved not in ends:
        raise ValueError(f"the weight's {convolved} channels end no leading run of the sections {sections}")
    return list(zip([0, *ends[:-1]], ends, strict=True)), ends.index(convolved) + 1


class _SplitConvSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, starts, sections):
        bounds, n = _bounds(sections, weight.shape[0])
        ctx.set_materialize_grads(False)  # an unused section's gradient stays None: nothing to compute
        ctx.save_for_backward(x, weight, starts)
        ctx.bounds, ctx.n = bounds, n
        convolved = [_forward(x[..., a:e], weight[a:e], starts) for a, e in bounds[:n]]
        return (*convolved, *(x[..., a:e] for a, e in bounds[n:]))

    @staticmethod
    def backward(ctx, *grads):
        x, weight, starts = ctx.saved_tensors
        bounds, n = ctx.bounds, ctx.n
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = _backward(grads[:n], bounds[:n], x, weight, starts, dx, ctx.needs_input_grad[1])
        if dx is not None:
            for (a, e), dy in zip(bounds[n:], grads[n:], strict=True):
                dx[..., a:e].zero_() if dy is None else dx[..., a:e].copy_(dy)
        return dx, dw, None, None


def _forward(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    b, s, c = x.shape
    y = torch.empty(b, s, c, dtype=x.dtype, device=x.device)
    bt, bc, warps = BLOCKS
    _fwd_kernel[(triton.cdiv(s, bt), triton.cdiv(c, bc), b)](
        x, weight, y, x if starts is None else starts, s, c, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        K=weight.shape[1], HAS_START=starts is not None, BT=bt, BC=bc, num_warps=warps,
    )  # fmt: skip
    return y


def _backward(dys, bounds, x, weight, starts, dx, weight_grad: bool) -> torch.Tensor | None:
    """The convolved sections' input gradients, written into ``dx`` (None: not wanted), and the weight
    gradient (``weight_grad``), summed once from every section's per-block partials."""
    b, s, _ = x.shape
    c, k = weight.shape
    bt, bc, warps = BLOCKS
    rows = b * triton.cdiv(s, bt)
    partial = torch.empty(rows, c, k, dtype=torch.float32, device=x.device) if weight_grad else None
    start = x if starts is None else starts
    for (a, e), dy in zip(bounds, dys, strict=True):
        width = e - a
        if dy is None:  # this section's output was not used: no gradient through it
            if dx is not None:
                dx[..., a:e].zero_()
            if partial is not None:
                partial[:, a:e].zero_()
            continue
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        grid = (triton.cdiv(s, bt), triton.cdiv(width, bc), b)
        ds = torch.empty(b, s, width, dtype=x.dtype, device=x.device)
        xs, ws = x[..., a:e], weight[a:e]
        part = ds if partial is None else partial[:, a:e]
        _bwd_silu_kernel[grid](
            xs, ws, dy, start, ds, part, s, width, xs.stride(0), xs.stride(1), dy.stride(0), dy.stride(1),
            part.stride(0), K=k, HAS_START=starts is not None, WEIGHT_GRAD=partial is not None, BT=bt, BC=bc,
            num_warps=warps,
        )  # fmt: skip
        if dx is not None:
            out = dx[..., a:e]
            _bwd_input_kernel[grid](
                ds, ws, start, out, s, width, out.stride(0), out.stride(1), K=k, HAS_START=starts is not None,
                BT=bt, BC=bc, num_warps=warps,
            )  # fmt: skip
    return None if partial is None else partial.sum(0).to(weight.dtype)


if triton is not None:

    @triton.jit
    def _sequence_starts(start_ptr, t, tmask, HAS_START: tl.constexpr):
        """Each token's sequence start: from ``starts`` for a packed row, else 0."""
        if HAS_START:
            return tl.load(start_ptr + t, mask=tmask, other=0)
        return tl.zeros_like(t)

    @triton.jit
    def _tap(x_ptr, b, t, c, lo, tmask, cmask, s_xb, s_xt, j, K: tl.constexpr):
        """x[t - (K - 1) + j] for tokens ``t`` x channels ``c``, zero before each token's sequence start."""
        src = t - (K - 1) + j
        ok = tmask & (src >= lo)
        return tl.load(x_ptr + b * s_xb + src[:, None] * s_xt + c[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)  # fmt: skip

    @triton.jit
    def _conv_tile(x_ptr, w_ptr, start_ptr, b, t, c, tmask, cmask, s_xb, s_xt, K: tl.constexpr, HAS_START: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
        """The pre-activation of tokens ``t`` x channels ``c`` in fp32."""
        lo = _sequence_starts(start_ptr, t, tmask, HAS_START)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):
            tap = _tap(x_ptr, b, t, c, lo, tmask, cmask, s_xb, s_xt, j, K)
            w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0)
            acc += tap.to(tl.float32) * w.to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        start_ptr,
        S,
        C,
        s_xb,
        s_xt,
        s_yb,
        s_yt,
        K: tl.constexpr,
        HAS_START: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
    ):
        b = tl.program_id(2)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tmask, cmask = t < S, c < C
        a = _conv_tile(x_ptr, w_ptr, start_ptr, b, t, c, tmask, cmask, s_xb, s_xt, K, HAS_START, BT, BC)
        y = a * tl.sigmoid(a)
        tl.store(y_ptr + b * s_yb + t[:, None] * s_yt + c[None, :], y.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])  # fmt: skip

    @triton.jit
    def _bwd_silu_kernel(
        x_ptr,
        w_ptr,
        dy_ptr,
        start_ptr,
        ds_ptr,
        part_ptr,
        S,
        C,
        s_xb,
        s_xt,
        s_db,
        s_dt,
        s_pr,
        K: tl.constexpr,
        HAS_START: tl.constexpr,
        WEIGHT_GRAD: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
    ):
        """SiLU's gradient ds (rounded to the input dtype, [b, s, c] contiguous) and, with WEIGHT_GRAD, this
        token block's share of the weight gradient, sum over t of ds[t] * x[t - (K - 1) + j], in fp32."""
        b = tl.program_id(2)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tmask, cmask = t < S, c < C
        mask = tmask[:, None] & cmask[None, :]
        a = _conv_tile(x_ptr, w_ptr, start_ptr, b, t, c, tmask, cmask, s_xb, s_xt, K, HAS_START, BT, BC)
        sig = tl.sigmoid(a)
        dy = tl.load(dy_ptr + b * s_db + t[:, None] * s_dt + c[None, :], mask=mask, other=0.0).to(tl.float32)
        ds = dy * sig * (1.0 + a * (1.0 - sig))
        tl.store(ds_ptr + (b * S + t[:, None]) * C + c[None, :], ds.to(ds_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            lo = _sequence_starts(start_ptr, t, tmask, HAS_START)
            row = b * tl.num_programs(0) + tl.program_id(0)
            for j in tl.static_range(K):
                tap = _tap(x_ptr, b, t, c, lo, tmask, cmask, s_xb, s_xt, j, K)
                tl.store(part_ptr + row * s_pr + c * K + j, tl.sum(ds * tap.to(tl.float32), axis=0), mask=cmask)  # fmt: skip

    @triton.jit
    def _bwd_input_kernel(
        ds_ptr,
        w_ptr,
        start_ptr,
        dx_ptr,
        S,
        C,
        s_xb,
        s_xt,
        K: tl.constexpr,
        HAS_START: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
    ):
        """dx[t] = sum over j of w[j] * ds[t + (K - 1) - j], over the outputs of t's own sequence."""
        b = tl.program_id(2)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tmask, cmask = t < S, c < C
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):
            dst = t + (K - 1) - j
            ok = tmask & (dst < S)
            if HAS_START:  # the output at dst is in t's sequence where that sequence starts at or before t
                ok = ok & (tl.load(start_ptr + dst, mask=ok, other=0) <= t)
            d = tl.load(
                ds_ptr + (b * S + dst[:, None]) * C + c[None, :], mask=ok[:, None] & cmask[None, :], other=0.0
            )
            w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0)
            acc += d.to(tl.float32) * w.to(tl.float32)[None, :]
        tl.store(dx_ptr + b * s_xb + t[:, None] * s_xt + c[None, :], acc.to(dx_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])  # fmt: skip
