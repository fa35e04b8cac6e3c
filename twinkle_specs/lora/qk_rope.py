"""An adapted Qwen3 attention's path from the fused QKV output to attention's inputs, in one kernel each way.

megatron-core goes from ``linear_qkv``'s output [s, b, groups * (q heads per group + 2) * head] to the
attention's query, key and value in five steps: the split (a copy of the query, whose heads are
interleaved with the keys and values), the q and k norms, and RoPE on each. Their backwards add
two RoPE kernels, two norm kernels and a concatenation of the three gradients into QKV's layout.
With the norms frozen (LoRA; :mod:`.norm`) none of them needs more than a row of one head, so one
forward kernel reads each token's QKV row once and writes the rotated query and key and a contiguous
value, and one backward kernel writes the QKV gradient in place of the concatenation.

The arithmetic is that of the unfused path on the GPU, rounding at the same points: the norm as
:class:`~twinkle_specs.lora.norm.QKNorm` (fp32 statistics, output rounded to the activation dtype),
then Transformer Engine's fused RoPE (``apply_rope_fusion``: the frequencies' cos and sin in fp32,
non-interleaved halves, the product rounded once), and the backward likewise: RoPE's gradient rounded
to the activation dtype, then the norm's input gradient. The backward recomputes each row's
``1 / rms`` from the saved QKV output, which the key's strided view kept alive on the unfused path
anyway.
"""

from __future__ import annotations

import torch

from .fp8_amax import GradAmax
from .norm import MAX_WIDTH, _heads_view, frozen_on_gpu

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton the attention keeps megatron's unfused path
    triton = None

TOKENS_PER_PROGRAM = 8  # with WARPS: the fastest of a launch-size sweep on an H200
WARPS = 4


if triton is not None:
    from .fp8_amax import tile_amax

    @triton.jit
    def _cos_sin(freqs_ptr, pos, m, HALF: tl.constexpr, BH: tl.constexpr):
        """cos and sin of both halves of the frequency rows at ``pos`` ([tokens, BH] each)."""
        c = tl.arange(0, BH)
        p = freqs_ptr + pos.to(tl.int64)[:, None] * (2 * HALF) + c[None, :]
        f1 = tl.load(p, mask=m, other=0.0)
        f2 = tl.load(p + HALF, mask=m, other=0.0)
        return tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)

    @triton.jit
    def _rstd(x1, x2, eps, HALF: tl.constexpr):
        return 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)

    @triton.jit
    def _norm_rope(src, dst, w_ptr, eps, m, c1, s1, c2, s2, HALF: tl.constexpr, BH: tl.constexpr):
        """One head's rows: ``rope(rmsnorm(x) * w)``; ``src``/``dst`` point at the first half."""
        c = tl.arange(0, BH)
        cm = c < HALF
        dtype = dst.dtype.element_ty
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        rstd = _rstd(x1, x2, eps, HALF)[:, None]
        y1 = (x1 * rstd * tl.load(w_ptr + c, mask=cm).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        y2 = (x2 * rstd * tl.load(w_ptr + HALF + c, mask=cm).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        tl.store(dst, (y1 * c1 - y2 * s1).to(dtype), mask=m)
        tl.store(dst + HALF, (y2 * c2 + y1 * s2).to(dtype), mask=m)

    @triton.jit
    def _norm_rope_back(
        dsrc, x_src, dst, w_ptr, eps, m, c1, s1, c2, s2, HALF: tl.constexpr, BH: tl.constexpr
    ):
        """One head's input gradient: RoPE's backward (rounded), then the norm's (no weight gradient)."""
        c = tl.arange(0, BH)
        cm = c < HALF
        dtype = dst.dtype.element_ty
        do1 = tl.load(dsrc, mask=m, other=0.0).to(tl.float32)
        do2 = tl.load(dsrc + HALF, mask=m, other=0.0).to(tl.float32)
        dy1 = (do1 * c1 + do2 * s2).to(dtype).to(tl.float32)
        dy2 = (do2 * c2 - do1 * s1).to(dtype).to(tl.float32)
        x1 = tl.load(x_src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_src + HALF, mask=m, other=0.0).to(tl.float32)
        rstd = _rstd(x1, x2, eps, HALF)[:, None]
        g1 = dy1 * tl.load(w_ptr + c, mask=cm).to(tl.float32)[None, :]
        g2 = dy2 * tl.load(w_ptr + HALF + c, mask=cm).to(tl.float32)[None, :]
        xh1, xh2 = x1 * rstd, x2 * rstd
        dot = ((tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)) / (2 * HALF))[:, None]
        o1, o2 = (rstd * (g1 - xh1 * dot)).to(dtype), (rstd * (g2 - xh2 * dot)).to(dtype)
        tl.store(dst, o1, mask=m)
        tl.store(dst + HALF, o2, mask=m)
        return tl.maximum(tile_amax(o1, m), tile_amax(o2, m))

    @triton.jit
    def _rows(qkv_ptr, freqs_ptr, T, B, s_tok, s_grp, HALF: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr):
        """This program's tile: the mask, cos and sin, tokens (int64, token ``t`` at sequence position
        ``t // B``), columns, and its query group's QKV rows; a half head of ``HALF`` columns is a block
        of ``BH`` (a power of two), masked."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.arange(0, BH)[None, :]
        m = (t < T)[:, None] & (c < HALF)
        c1, s1, c2, s2 = _cos_sin(freqs_ptr, t // B, m, HALF, BH)
        t64 = t.to(tl.int64)[:, None]
        return m, c1, s1, c2, s2, t64, c, qkv_ptr + t64 * s_tok + tl.program_id(1) * s_grp + c

    @triton.jit
    def _qk_rope_fwd_kernel(
        qkv_ptr, wq_ptr, wk_ptr, freqs_ptr, q_ptr, k_ptr, v_ptr, T, B, s_tok, s_grp, eps_q, eps_k,
        QPG: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr,
    ):  # fmt: skip
        """Program (token block, query group): that group's query heads, key and value of ``BT`` tokens
        into contiguous [T, heads, 2 * HALF] outputs."""
        m, c1, s1, c2, s2, t64, c, row = _rows(qkv_ptr, freqs_ptr, T, B, s_tok, s_grp, HALF, BH, BT)
        g, groups = tl.program_id(1), tl.num_programs(1)
        for j in tl.static_range(QPG):
            dst = q_ptr + (t64 * groups * QPG + g * QPG + j) * (2 * HALF) + c
            _norm_rope(row + j * 2 * HALF, dst, wq_ptr, eps_q, m, c1, s1, c2, s2, HALF, BH)
        out = (t64 * groups + g) * (2 * HALF) + c
        _norm_rope(row + QPG * 2 * HALF, k_ptr + out, wk_ptr, eps_k, m, c1, s1, c2, s2, HALF, BH)
        v = row + (QPG + 1) * 2 * HALF
        tl.store(v_ptr + out, tl.load(v, mask=m), mask=m)
        tl.store(v_ptr + out + HALF, tl.load(v + HALF, mask=m), mask=m)

    @triton.jit
    def _qk_rope_bwd_kernel(
        qkv_ptr, wq_ptr, wk_ptr, freqs_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, amax_ptr, T, B, s_tok, s_grp,
        q_tok, q_head, k_tok, k_head, v_tok, v_head, eps_q, eps_k,
        QPG: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, AMAX: tl.constexpr,
    ):  # fmt: skip
        """The forward's programs in reverse: the QKV output's gradient [T, groups, (QPG + 2) * 2 * HALF]
        from the query's, key's and value's (strided [T, heads, 2 * HALF] each); with ``AMAX`` each
        program's largest |gradient| as written goes to ``amax_ptr`` [programs]."""
        m, c1, s1, c2, s2, t64, c, row = _rows(qkv_ptr, freqs_ptr, T, B, s_tok, s_grp, HALF, BH, BT)
        g = tl.program_id(1)
        drow = dqkv_ptr + (t64 * tl.num_programs(1) + g) * ((QPG + 2) * 2 * HALF) + c
        mx = 0.0
        for j in tl.static_range(QPG):
            src = dq_ptr + t64 * q_tok + (g * QPG + j) * q_head + c
            off = j * 2 * HALF
            mx = tl.maximum(
                mx, _norm_rope_back(src, row + off, drow + off, wq_ptr, eps_q, m, c1, s1, c2, s2, HALF, BH)
            )
        off = QPG * 2 * HALF
        src = dk_ptr + t64 * k_tok + g * k_head + c
        mx = tl.maximum(
            mx, _norm_rope_back(src, row + off, drow + off, wk_ptr, eps_k, m, c1, s1, c2, s2, HALF, BH)
        )
        dv = dv_ptr + t64 * v_tok + g * v_head + c
        off = (QPG + 1) * 2 * HALF
        dv1, dv2 = tl.load(dv, mask=m), tl.load(dv + HALF, mask=m)
        tl.store(drow + off, dv1, mask=m)
        tl.store(drow + off + HALF, dv2, mask=m)
        if AMAX:
            mx = tl.maximum(mx, tl.maximum(tile_amax(dv1, m), tile_amax(dv2, m)))
            tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + g, mx)


def _block(head: int) -> int:
    return triton.next_power_of_2(head // 2)


def fusable(x: torch.Tensor, head: int, *weights: torch.Tensor) -> bool:
    """Whether :func:`qk_norm_rope` runs for activations like ``x``: :func:`~.norm.frozen_on_gpu` and an
    even head width."""
    return frozen_on_gpu(x, *weights) and 2 <= head <= MAX_WIDTH and head % 2 == 0


class QKNormRope(torch.autograd.Function):
    """``mixed_qkv`` [s, b, groups * (qpg + 2) * head] -> query [s, b, groups * qpg, head], key and value
    [s, b, groups, head]; query and key normed by their frozen weights and rotated by ``freqs`` [s, head]
    (fp32 angles, megatron's rotary embedding). Saves the QKV output, nothing else of size."""

    @staticmethod
    def forward(
        ctx, mixed_qkv, wq, wk, freqs, groups: int, head: int, eps_q: float, eps_k: float, grad_amax=None
    ):
        s, b, width = mixed_qkv.shape
        qpg = width // (groups * head) - 2
        qkv = _heads_view(mixed_qkv.unflatten(-1, (groups, -1)))  # [T, groups, row]
        q = mixed_qkv.new_empty(s, b, groups * qpg, head)
        k, v = mixed_qkv.new_empty(s, b, groups, head), mixed_qkv.new_empty(s, b, groups, head)
        grid = (triton.cdiv(s * b, TOKENS_PER_PROGRAM), groups)
        _qk_rope_fwd_kernel[grid](
            qkv, wq, wk, freqs, q, k, v, s * b, b, qkv.stride(0), qkv.stride(1), eps_q, eps_k,
            QPG=qpg, HALF=head // 2, BH=_block(head), BT=TOKENS_PER_PROGRAM, num_warps=WARPS,
        )  # fmt: skip
        ctx.save_for_backward(qkv, wq, wk, freqs)
        ctx.dims, ctx.eps, ctx.grad_amax = (s, b, groups, qpg, head), (eps_q, eps_k), grad_amax
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, wq, wk, freqs = ctx.saved_tensors
        s, b, groups, qpg, head = ctx.dims
        shapes = ((s, b, groups * qpg, head), (s, b, groups, head), (s, b, groups, head))
        dq, dk, dv = (  # an output that got no gradient (unused) contributes zeros
            qkv.new_zeros(shape) if d is None else _heads_view(d)
            for d, shape in zip((dq, dk, dv), shapes, strict=True)
        )
        dqkv = qkv.new_empty(s, b, groups * (qpg + 2) * head)
        grid = (triton.cdiv(s * b, TOKENS_PER_PROGRAM), groups)
        link = ctx.grad_amax
        partials = torch.empty(grid[0] * grid[1], device=qkv.device, dtype=torch.float32) if link else None
        _qk_rope_bwd_kernel[grid](
            qkv, wq, wk, freqs, dq, dk, dv, dqkv, partials, s * b, b, qkv.stride(0), qkv.stride(1),
            dq.stride(-3), dq.stride(-2), dk.stride(-3), dk.stride(-2), dv.stride(-3), dv.stride(-2),
            *ctx.eps, QPG=qpg, HALF=head // 2, BH=_block(head), BT=TOKENS_PER_PROGRAM, AMAX=link is not None,
            num_warps=WARPS,
        )  # fmt: skip
        if link is not None:
            link.give(dqkv, partials)
        return dqkv, None, None, None, None, None, None, None, None


def qk_norm_rope(
    mixed_qkv: torch.Tensor,
    groups: int,
    q_norm: torch.nn.Module,
    k_norm: torch.nn.Module,
    freqs: torch.Tensor,
    grad_amax: GradAmax | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value for attention from ``linear_qkv``'s output (megatron's layout: per query
    group its query heads, then its key and value head), with the q/k norms (:class:`QKNorm`: ``weight``,
    ``eps``) and RoPE by ``freqs`` [s, 1, 1, head] applied; see the module docstring. ``grad_amax``: the
    backward kernel also takes the amax of the QKV gradient it writes and gives it there (FP8 current
    scaling, :mod:`~twinkle_specs.lora.fp8_amax`)."""
    head = q_norm.weight.shape[0]
    if freqs.shape != (mixed_qkv.shape[0], 1, 1, head):
        raise ValueError(
            f"qk_norm_rope: rotary frequencies {tuple(freqs.shape)} for a QKV output "
            f"{tuple(mixed_qkv.shape)} (expected [{mixed_qkv.shape[0]}, 1, 1, {head}])"
        )
    f = freqs.reshape(freqs.shape[0], head).float().contiguous()
    return QKNormRope.apply(
        mixed_qkv, q_norm.weight, k_norm.weight, f, groups, head, q_norm.eps, k_norm.eps, grad_amax
    )
