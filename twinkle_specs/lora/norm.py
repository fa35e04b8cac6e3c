"""The per-head q/k RMSNorm of an adapted Qwen3 attention, without the frozen weight's gradient.

Under LoRA the norms are frozen, yet Transformer Engine's RMSNorm backward always computes the weight
gradient: a partial sum per block of rows and a finalize kernel that reduces them. For the q/k norms
(rows of one 128-wide head, a row per token and head) that finalize is the slowest norm kernel of the
step: 79 us per call, 1.26 ms of a 75 ms LoRA step on the Qwen3-8B shape (8 layers, 4096 tokens,
H200). torch's fused RMSNorm skips it but is slower
than TE on these narrow rows (measured on an H200). So with the weight frozen, on CUDA, two small
Triton kernels run it: the forward keeps each row's 1/rms, the backward writes the input gradient
only; a strided input (the key's view of the fused QKV output) is read in place. Otherwise (a
trainable weight, CPU, a width that is not a power of two) ``torch.nn.functional.rms_norm`` does.
The arithmetic is TE's: fp32 statistics and products, the output rounded once to the input dtype.

:class:`HiddenNorm`: the layer norm in front of an adapted QKV or fc1 (LoRA splits it from TE's fused
linear, :mod:`.spec`), frozen too, by two such kernels over whole hidden rows: no weight-gradient partials
and finalize in the backward, and under FP8 current scaling the forward also takes its output's amax,
which the linear's FP8 cast then need not read the tensor again for (:mod:`.fp8_amax`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..te_extra_state import TEExtraState
from .fp8_amax import current_scaling, tag

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU tensors and machines without Triton
    triton = None

ROWS_PER_PROGRAM = 32
MAX_WIDTH = 1024


if triton is not None:
    from .fp8_amax import tile_amax

    @triton.jit
    def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, heads, s_tok, s_head, eps,
                    N: tl.constexpr, BR: tl.constexpr):  # fmt: skip
        """Rows ``r`` of ``x`` viewed as [tokens, heads, N] (strides ``s_tok``, ``s_head``, 1):
        ``y = x / rms(x) * w`` into a contiguous [rows, N], and ``1 / rms`` per row."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.arange(0, N)
        rm = r < rows
        r64 = r.to(tl.int64)
        off = (r64 // heads) * s_tok + (r64 % heads) * s_head
        x = tl.load(x_ptr + off[:, None] + c[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(w_ptr + c).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + r64[:, None] * N + c[None, :], y.to(y_ptr.dtype.element_ty), mask=rm[:, None])
        tl.store(rstd_ptr + r, rstd, mask=rm)

    @triton.jit
    def _bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, rows, heads, s_tok, s_head, d_tok, d_head,
                    N: tl.constexpr, BR: tl.constexpr):  # fmt: skip
        """The input gradient ``rstd * (g - xh * mean(g * xh))`` for ``g = dy * w``, ``xh = x * rstd``,
        into a contiguous [rows, N]; no weight gradient."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.arange(0, N)
        rm = r < rows
        r64 = r.to(tl.int64)
        tok, head = r64 // heads, r64 % heads
        m = rm[:, None]
        x = tl.load(x_ptr + (tok * s_tok + head * s_head)[:, None] + c[None, :], mask=m, other=0.0)
        dy = tl.load(dy_ptr + (tok * d_tok + head * d_head)[:, None] + c[None, :], mask=m, other=0.0)
        rstd = tl.load(rstd_ptr + r, mask=rm, other=0.0)
        w = tl.load(w_ptr + c).to(tl.float32)
        g = dy.to(tl.float32) * w[None, :]
        xh = x.to(tl.float32) * rstd[:, None]
        dot = tl.sum(g * xh, axis=1) / N
        dx = rstd[:, None] * (g - xh * dot[:, None])
        tl.store(dx_ptr + r64[:, None] * N + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _row_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, amax_ptr, rows, eps, N: tl.constexpr, BN: tl.constexpr,
                        BR: tl.constexpr, ZC: tl.constexpr, AMAX: tl.constexpr):  # fmt: skip
        """``BR`` rows of a contiguous [rows, N] ``x``: ``y = x / rms(x) * w`` (``w + 1`` with ``ZC``), ``1 / rms``
        per row and, with ``AMAX``, the largest |y| (as rounded) of the program's rows."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.arange(0, BN)
        m = (r < rows)[:, None] & (c < N)[None, :]
        off = r.to(tl.int64)[:, None] * N + c[None, :]
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        if ZC:
            w = w + 1.0
        y = (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + off, y, mask=m)
        tl.store(rstd_ptr + r, rstd, mask=r < rows)
        if AMAX:
            tl.store(amax_ptr + tl.program_id(0), tile_amax(y, m))

    @triton.jit
    def _row_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, rows, N: tl.constexpr, BN: tl.constexpr,
                        BR: tl.constexpr, ZC: tl.constexpr):  # fmt: skip
        """:func:`_bwd_kernel`'s input gradient over ``BR`` contiguous rows of ``N``; no weight gradient."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.arange(0, BN)
        m = (r < rows)[:, None] & (c < N)[None, :]
        off = r.to(tl.int64)[:, None] * N + c[None, :]
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        if ZC:
            w = w + 1.0
        g = dy * w[None, :]
        xh = x * rstd[:, None]
        dot = tl.sum(g * xh, axis=1) / N
        tl.store(dx_ptr + off, (rstd[:, None] * (g - xh * dot[:, None])).to(dx_ptr.dtype.element_ty), mask=m)


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., (heads,) N] as [tokens, heads, N] with a unit last stride (a view where possible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    shape = (-1, t.shape[-2], t.shape[-1]) if t.dim() >= 3 else (-1, 1, t.shape[-1])
    try:
        return t.view(shape)
    except RuntimeError:  # leading dims that do not flatten into one stride
        return t.contiguous().view(shape)


def frozen_on_gpu(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether Triton kernels for norm weights that get no gradient here can run on ``x``: Triton, CUDA,
    a float dtype (also :mod:`.qk_rope`'s condition, besides its head width)."""
    return (
        triton is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
    )


def _use_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n = x.shape[-1]
    return frozen_on_gpu(x, weight) and n <= MAX_WIDTH and n & (n - 1) == 0


class FrozenRMSNorm(torch.autograd.Function):
    """RMSNorm with a weight that gets no gradient; saves ``x`` and the per-row ``1 / rms``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x3 = _heads_view(x)
        tokens, heads, n = x3.shape
        rows = tokens * heads
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
        _fwd_kernel[grid](
            x3, weight, y, rstd, rows, heads, x3.stride(0), x3.stride(1), eps, N=n, BR=ROWS_PER_PROGRAM
        )
        ctx.save_for_backward(x3, weight, rstd)
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x3, weight, rstd = ctx.saved_tensors
        tokens, heads, n = x3.shape
        dy3 = _heads_view(dy)
        dx = torch.empty(ctx.shape, dtype=x3.dtype, device=x3.device)
        grid = (triton.cdiv(tokens * heads, ROWS_PER_PROGRAM),)
        _bwd_kernel[grid](
            dy3, x3, weight, rstd, dx, tokens * heads, heads, x3.stride(0), x3.stride(1),
            dy3.stride(0), dy3.stride(1), N=n, BR=ROWS_PER_PROGRAM,
        )  # fmt: skip
        return dx, None, None


class QKNorm(TEExtraState, torch.nn.Module):
    """RMSNorm over the last dimension with TENorm's constructor and parameter (``weight``) and its
    empty ``_extra_state``, so checkpoint keys and the HF weight map are unchanged; frozen: see the
    module docstring."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if config.normalization != "RMSNorm" or getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError(
                f"QKNorm is an RMSNorm with a plain gamma; the config has --normalization "
                f"{config.normalization}, layernorm_zero_centered_gamma="
                f"{getattr(config, 'layernorm_zero_centered_gamma', False)}"
            )
        self.config, self.eps, self.hidden_size = config, eps, hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        # as TE's norms mark theirs: megatron all-reduces such weights' gradients over tensor parallelism
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x, self.weight):
            return FrozenRMSNorm.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.weight.to(x.dtype), self.eps)


def _row_launch(n: int) -> tuple[int, int, int]:
    """``(BN, BR, warps)`` for rows of ``n``: a power-of-two block over the row, rows per program up to 4096
    elements, 8 warps from 4096 elements on (16 from 8192)."""
    bn = triton.next_power_of_2(n)
    br = max(1, min(16, 4096 // bn))
    return bn, br, 16 if bn >= 8192 else 8 if bn * br >= 4096 else 4


class FrozenRowRMSNorm(torch.autograd.Function):
    """RMSNorm over whole rows with a weight that gets no gradient (:class:`HiddenNorm`); with ``amax`` the
    output carries its partial maxima (:func:`~twinkle_specs.lora.fp8_amax.tag`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, amax: bool):
        n = weight.numel()
        x2 = x.contiguous().view(-1, n)
        rows = x2.shape[0]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        bn, br, warps = _row_launch(n)
        grid = (triton.cdiv(rows, br),)
        partials = torch.empty(grid[0], dtype=torch.float32, device=x.device) if amax else None
        _row_fwd_kernel[grid](
            x2, weight, y, rstd, partials, rows, eps, N=n, BN=bn, BR=br, ZC=zero_centered, AMAX=amax,
            num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        ctx.zero_centered = zero_centered
        return y if partials is None else tag(y, partials)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dx = torch.empty(dy.shape, dtype=x2.dtype, device=x2.device)
        bn, br, warps = _row_launch(n)
        _row_bwd_kernel[(triton.cdiv(rows, br),)](
            dy.contiguous(),
            x2,
            weight,
            rstd,
            dx,
            rows,
            N=n,
            BN=bn,
            BR=br,
            ZC=ctx.zero_centered,
            num_warps=warps,
        )
        return dx, None, None, None, None


class HiddenNorm(TEExtraState, torch.nn.Module):
    """The RMSNorm in front of an adapted QKV or fc1 (module docstring): TENorm's constructor, parameter
    (``weight``, zero-centred where the config says so) and empty ``_extra_state``, so checkpoint keys and
    the HF weight map are unchanged. A config with another normalization gets TENorm's own module."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5):
        if config.normalization != "RMSNorm":
            from megatron.core.extensions.transformer_engine import TENorm

            return TENorm(config, hidden_size, eps)
        return super().__new__(cls)

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.config, self.eps, self.hidden_size = config, eps, hidden_size
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        # as TE's norms mark theirs: megatron all-reduces such weights' gradients over tensor parallelism
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if frozen_on_gpu(x, self.weight):
            return FrozenRowRMSNorm.apply(
                x, self.weight, self.eps, self.zero_centered_gamma, current_scaling()
            )
        w = self.weight.float() + 1.0 if self.zero_centered_gamma else self.weight.float()
        return F.rms_norm(x.float(), (self.hidden_size,), w, self.eps).to(x.dtype)
