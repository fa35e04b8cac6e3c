"""SwiGLU over fc1's frozen output plus its LoRA delta, ``swiglu(pre + h @ b.T)``, in one kernel.

Adding the low-rank delta to fc1's output in place (a cuBLAS beta=1 GEMM) reads and writes the whole
[T, 2F] pre-activation only for SwiGLU to read it again (206 us per layer at T=4096, F=12288 on an
H100, twice SwiGLU's own ~100 us). Here each tile of the pre-activation gets its delta from the small ``h`` and
``b`` tiles (``tl.dot``, fp32 accumulate) on the way into SwiGLU, so the sum is never stored.

Rounding follows the unfused path: the delta is accumulated in fp32, added to ``pre`` in fp32 and the
sum rounded once to the activation dtype (as cuBLAS's beta=1 epilogue does); SwiGLU and its gradient
(megatron-core's ``swiglu_back``) are computed in fp32 from that rounded sum and rounded once.
Backward saves ``pre``, ``h`` and ``b``, not the sum, and recomputes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU tensors and machines without Triton
    triton = None

# One fixed launch configuration: autotuning would have to finish before CUDA-graph capture.
BLOCK_T, BLOCK_F, NUM_WARPS = 64, 128, 8


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [T, n] (a view where the leading dims allow one)."""
    return x.reshape(-1, x.shape[-1])


def _preact_ref(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``pre + h @ b.T`` as [T, 2F]: fp32 products and sum, rounded once to ``pre``'s dtype."""
    return torch.addmm(_flat(pre).float(), _flat(h).float(), b.float().t()).to(pre.dtype)


def _swiglu_ref(y: torch.Tensor) -> torch.Tensor:
    y1, y2 = y.float().chunk(2, -1)
    return (F.silu(y1) * y2).to(y.dtype)


def _swiglu_back_ref(dout: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``swiglu_back`` in fp32, rounded once to ``y``'s dtype."""
    g, (y1, y2) = dout.float(), y.float().chunk(2, -1)
    s = torch.sigmoid(y1)
    return torch.cat((g * s * (1 + y1 * (1 - s)) * y2, g * y1 * s), -1).to(y.dtype)


if triton is not None:

    @triton.jit
    def _dot_bt(a, b, DOT_F32: tl.constexpr):
        """``a @ b.T`` in fp32. DOT_F32 (CPU tensors, i.e. the Triton interpreter, whose 3.6 ``tl.dot``
        multiplies bf16 bit patterns as integers) upcasts first: exact products, same sums."""
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b))
        return acc

    @triton.jit
    def _preact_tile(
        pre_ptr, h_ptr, b_ptr, t, f, T, F, R, s_pre, s_h, s_b, BR: tl.constexpr, DOT_F32: tl.constexpr
    ):
        """The (t, f) tiles of gate and up of ``pre + h @ b.T``, rounded to pre's dtype, as fp32."""
        r = tl.arange(0, BR)
        tm, fm, rm = t < T, f < F, r < R
        rows = t.to(tl.int64)[:, None]
        hh = tl.load(h_ptr + rows * s_h + r[None, :], mask=tm[:, None] & rm[None, :], other=0.0)
        bm = fm[:, None] & rm[None, :]
        bg = tl.load(b_ptr + f[:, None] * s_b + r[None, :], mask=bm, other=0.0)
        bu = tl.load(b_ptr + (f + F)[:, None] * s_b + r[None, :], mask=bm, other=0.0)
        m = tm[:, None] & fm[None, :]
        p = pre_ptr + rows * s_pre + f[None, :]
        dtype = pre_ptr.dtype.element_ty
        y1 = tl.load(p, mask=m, other=0.0).to(tl.float32) + _dot_bt(hh, bg, DOT_F32)
        y2 = tl.load(p + F, mask=m, other=0.0).to(tl.float32) + _dot_bt(hh, bu, DOT_F32)
        return y1.to(dtype).to(tl.float32), y2.to(dtype).to(tl.float32)

    @triton.jit
    def _fwd_kernel(
        pre_ptr,
        h_ptr,
        b_ptr,
        out_ptr,
        T,
        F,
        R,
        s_pre,
        s_h,
        s_b,
        s_out,
        BT: tl.constexpr,
        BF: tl.constexpr,
        BR: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        f = tl.program_id(1) * BF + tl.arange(0, BF)
        y1, y2 = _preact_tile(pre_ptr, h_ptr, b_ptr, t, f, T, F, R, s_pre, s_h, s_b, BR, DOT_F32)
        out = y1 * tl.sigmoid(y1) * y2
        m = (t < T)[:, None] & (f < F)[None, :]
        tl.store(
            out_ptr + t.to(tl.int64)[:, None] * s_out + f[None, :], out.to(out_ptr.dtype.element_ty), mask=m
        )

    @triton.jit
    def _bwd_kernel(
        pre_ptr,
        h_ptr,
        b_ptr,
        dout_ptr,
        dy_ptr,
        T,
        F,
        R,
        s_pre,
        s_h,
        s_b,
        s_dout,
        s_dy,
        BT: tl.constexpr,
        BF: tl.constexpr,
        BR: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        f = tl.program_id(1) * BF + tl.arange(0, BF)
        y1, y2 = _preact_tile(pre_ptr, h_ptr, b_ptr, t, f, T, F, R, s_pre, s_h, s_b, BR, DOT_F32)
        m = (t < T)[:, None] & (f < F)[None, :]
        rows = t.to(tl.int64)[:, None]
        g = tl.load(dout_ptr + rows * s_dout + f[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(y1)
        dtype = dy_ptr.dtype.element_ty
        p = dy_ptr + rows * s_dy + f[None, :]
        tl.store(p, (g * s * (1 + y1 * (1 - s)) * y2).to(dtype), mask=m)
        tl.store(p + F, (g * y1 * s).to(dtype), mask=m)


def _use_triton(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        triton is not None
        and pre.is_cuda
        and pre.dtype in (torch.bfloat16, torch.float16)
        and all(x.stride(-1) == 1 for x in (pre, h, b))
    )


def _launch(kernel, pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor, *extra: torch.Tensor) -> None:
    """Runs ``kernel`` over [T, 2F] ``pre`` with its [T, n] tensor arguments ``extra`` (row strides passed)."""
    T, F2 = pre.shape
    R = h.shape[1]
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(F2 // 2, BLOCK_F))
    kernel[grid](
        pre, h, b, *extra, T, F2 // 2, R, *(x.stride(0) for x in (pre, h, b, *extra)),
        BT=BLOCK_T, BF=BLOCK_F, BR=max(16, triton.next_power_of_2(R)), DOT_F32=not pre.is_cuda,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def _triton_forward(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    pre2, h2 = _flat(pre), _flat(h)
    out = pre.new_empty(pre2.shape[0], pre2.shape[1] // 2)
    _launch(_fwd_kernel, pre2, h2, b, out)
    return out.view(*pre.shape[:-1], -1)


def _triton_swiglu_back(
    dout: torch.Tensor, pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """d(pre) = d(pre + h @ b.T) as [T, 2F]."""
    pre2 = _flat(pre)
    dy = torch.empty_like(pre2, memory_format=torch.contiguous_format)
    _launch(_bwd_kernel, pre2, _flat(h), b, _flat(dout.contiguous()), dy)
    return dy


def _check(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> None:
    if pre.shape[-1] % 2 or b.shape != (pre.shape[-1], h.shape[-1]) or pre.shape[:-1] != h.shape[:-1]:
        raise ValueError(
            f"swiglu_lora: shapes pre {tuple(pre.shape)}, h {tuple(h.shape)}, b {tuple(b.shape)}"
        )
    if h.dtype != pre.dtype or b.dtype != pre.dtype:
        raise ValueError(f"swiglu_lora: dtypes pre {pre.dtype}, h {h.dtype}, b {b.dtype} differ")


def swiglu_lora_forward(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``swiglu(pre + h @ b.T)`` without autograd: bit-identical to :func:`swiglu_lora`'s output (same
    kernel, no atomics), for recomputing that output in a backward."""
    _check(pre, h, b)
    with torch.no_grad():
        if _use_triton(pre, h, b):
            return _triton_forward(pre, h, b)
        return _swiglu_ref(_preact_ref(pre, h, b)).view(*pre.shape[:-1], -1)


class SwigluLora(torch.autograd.Function):
    """``swiglu(pre + h @ b.T)``; saves the inputs (not the [T, 2F] sum) and recomputes the sum."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pre, h, b)
        return swiglu_lora_forward(pre, h, b)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pre, h, b = ctx.saved_tensors
        if _use_triton(pre, h, b):
            dy = _triton_swiglu_back(dout, pre, h, b)
        else:
            dy = _swiglu_back_ref(_flat(dout), _preact_ref(pre, h, b))
        d_pre, d_h, d_b = ctx.needs_input_grad
        return (
            dy.view(pre.shape) if d_pre else None,
            (dy @ b).view(h.shape) if d_h else None,
            dy.t() @ _flat(h) if d_b else None,
        )


def swiglu_lora(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``swiglu(pre + h @ b.T)`` for pre [..., 2F] (gate | up), h [..., R], b [2F, R], one dtype."""
    return SwigluLora.apply(pre, h, b)
