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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..te_extra_state import TEExtraState

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU tensors and machines without Triton
    triton = None

ROWS_PER_PROGRAM = 32
MAX_WIDTH = 1024


if triton is not None:

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
