"""An adapted MLP's SwiGLU with the adapters of fc1 and fc2 folded into its kernels.

Forward: ``swiglu(pre + h @ b.T)`` for fc1's frozen output ``pre`` and its LoRA delta ``h @ b.T``, where
``b`` [2F, R] is either fc1's fused B (gate's and up's blocks side by side, zeros elsewhere: ``h`` [T, R])
or, with gate and up adapted at one rank, fc1's own B (``h`` [T, 2R]: gate's columns, then up's; each
half of ``b`` meets its own half of ``h``, so no zero block is built, gathered or multiplied). Adding
the delta to fc1's output in place (a cuBLAS beta=1 GEMM) reads and writes the whole [T, 2F]
pre-activation only for SwiGLU to read it again (206 us per layer at T=4096, F=12288 on an H100, twice
SwiGLU's own time); here each tile gets its delta from the small ``h`` and ``b`` tiles on the way in.

Backward, one pass over the [T, 2F] pre-activation for what the unfused path does in five (on the
same shape: SwiGLU's backward, fc1's B gradient, fc2's input recompute, fc2's A gradient and fc2's
input-gradient sum): each program owns a block of F columns and walks the tokens, so it recomputes the
pre-activation, adds fc2's adapter input gradient ``s2 * dh2 @ a2`` to ``dout`` tile by tile (fc2's
:class:`~twinkle_specs.lora.functions.LowRankDown` defers it here through its link, with its scaling
``s2``), writes SwiGLU's gradient, and accumulates ``b``'s gradient (``dy.T @ h``) and ``a2``'s
(``s2 * dh2.T @ act``) in registers: no atomics, the same result every run.

Rounding follows the unfused path: the delta is accumulated in fp32, added in fp32 and the sum rounded
once to the activation dtype (as cuBLAS's beta=1 epilogue does), likewise fc2's input gradient (whose
scaling multiplies ``a2`` once per program, rounded to its dtype: exact for a power of two); SwiGLU
and its gradient (megatron-core's ``swiglu_back``) are computed in fp32 from the rounded values and
rounded once. Backward saves ``pre``, ``h``, ``b`` (and ``a2``), not the sum, and recomputes it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # no runtime import: tests load this file on its own, without its package
    from .fp8_amax import SwigluFp8
    from .functions import GradLink

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU tensors and machines without Triton
    triton = None

# Fixed launch configurations (autotuning would have to finish before CUDA-graph capture): forward (token
# block, F block, warps), swept on an H100 at the Qwen3-8B shape; backward (token block, F block, warps,
# pipeline stages, programs resident per SM), swept on an H200 at Qwen3-8B's, Qwen3-1.7B's and
# Qwen2.5-1.5B's shapes. The backward's loop loads the next token tile by hand, so the compiler's
# pipelining adds nothing; 123 registers a thread let 4 programs share an SM, and the grid takes as many
# token chunks as fill those slots once (slots left empty, or a second wave partly filled, cost up to 37 %).
FWD_BLOCKS = (16, 128, 4)
BWD_BLOCKS = (16, 64, 4, 1, 4)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [T, n] (a view where the leading dims allow one)."""
    return x.reshape(-1, x.shape[-1])


def _halves(h: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``h`` holds gate's and up's columns apart ([T, 2R] for ``b`` [2F, R])."""
    return h.shape[-1] == 2 * b.shape[-1]


def _block_b(b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``b`` as the [2F, width of h] matrix ``h`` multiplies: with halves, gate's rows on gate's
    columns and up's on up's (zeros elsewhere); else ``b`` itself."""
    if not _halves(h, b):
        return b
    f, r = b.shape[0] // 2, b.shape[1]
    zeros = b.new_zeros(f, r)
    return torch.cat([torch.cat([b[:f], zeros], 1), torch.cat([zeros, b[f:]], 1)])


def _preact_ref(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``pre + h @ b.T`` as [T, 2F]: fp32 products and sum, rounded once to ``pre``'s dtype."""
    return torch.addmm(_flat(pre).float(), _flat(h).float(), _block_b(b, h).float().t()).to(pre.dtype)


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
    def _dot(a, b, DOT_F32: tl.constexpr):
        """``a @ b`` in fp32. DOT_F32 (CPU tensors, i.e. the Triton interpreter, whose 3.6 ``tl.dot``
        multiplies bf16 bit patterns as integers) upcasts first: exact products, same sums."""
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b)
        return acc

    @triton.jit
    def _preact_half(p, h, bt, dtype: tl.constexpr, DOT_F32: tl.constexpr):
        """One half (gate or up) of ``pre + h @ b.T`` for ``pre``'s loaded tile ``p``, rounded to ``dtype``, as
        fp32; ``bt`` is the half's rows of ``b``, transposed ([R, F block]), ``h`` the columns of ``h`` they
        meet (the same tile for both halves unless ``h`` has halves)."""
        return (p.to(tl.float32) + _dot(h, bt, DOT_F32)).to(dtype).to(tl.float32)

    @triton.jit
    def _preact(p, m, hg, hu, bg, bu, F, dtype: tl.constexpr, DOT_F32: tl.constexpr):
        """Gate and up tiles of ``pre + h @ b.T`` at ``p`` (the gate tile's pointers; see :func:`_preact_half`)."""
        y1 = _preact_half(tl.load(p, mask=m, other=0.0), hg, bg, dtype, DOT_F32)
        y2 = _preact_half(tl.load(p + F, mask=m, other=0.0), hu, bu, dtype, DOT_F32)
        return y1, y2

    @triton.jit
    def _h_tiles(h_ptr, rows, s_h, r, hm, R, HALVES: tl.constexpr):
        """The tiles of ``h`` that gate's and up's rows of ``b`` meet (columns ``R`` on with halves)."""
        hg = tl.load(h_ptr + rows * s_h + r[None, :], mask=hm, other=0.0)
        if HALVES:
            hu = tl.load(h_ptr + rows * s_h + R + r[None, :], mask=hm, other=0.0)
        else:
            hu = hg
        return hg, hu

    @triton.jit
    def _fwd_kernel(
        pre_ptr, h_ptr, b_ptr, out_ptr, amax_ptr, T, F, R, s_pre, s_h, s_b, s_out,
        BT: tl.constexpr, BF: tl.constexpr, BR: tl.constexpr, HALVES: tl.constexpr, DOT_F32: tl.constexpr,
        AMAX: tl.constexpr,
    ):  # fmt: skip
        """With AMAX, each program also stores the largest |output| of its tile (as rounded) into
        ``amax_ptr`` [programs]: the amax FP8 current scaling takes of this tensor, without another pass."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        f = tl.program_id(1) * BF + tl.arange(0, BF)
        r = tl.arange(0, BR)
        tm, fm, rm = t < T, f < F, r < R
        rows = t.to(tl.int64)[:, None]
        hg, hu = _h_tiles(h_ptr, rows, s_h, r, tm[:, None] & rm[None, :], R, HALVES)
        bm = rm[:, None] & fm[None, :]
        bg = tl.load(b_ptr + f[None, :] * s_b + r[:, None], mask=bm, other=0.0)
        bu = tl.load(b_ptr + (f + F)[None, :] * s_b + r[:, None], mask=bm, other=0.0)
        m = tm[:, None] & fm[None, :]
        dtype = out_ptr.dtype.element_ty
        y1, y2 = _preact(pre_ptr + rows * s_pre + f[None, :], m, hg, hu, bg, bu, F, dtype, DOT_F32)
        out = (y1 * tl.sigmoid(y1) * y2).to(dtype)
        tl.store(out_ptr + rows * s_out + f[None, :], out, mask=m)
        if AMAX:  # masked entries are 0 (their loads are)
            program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            tl.store(amax_ptr + program, tl.max(tl.max(tl.abs(out.to(tl.float32)), 1), 0))

    @triton.jit
    def _token_tile(t0, end, T, fm, BT: tl.constexpr):
        """The backward's token tile at ``t0``: its tokens' mask (those before ``end`` and ``T``), rows
        (int64, [BT, 1]) and the [BT, F block] mask."""
        t = t0 + tl.arange(0, BT)
        tm = (t < T) & (t < end)
        return tm, t.to(tl.int64)[:, None], tm[:, None] & fm[None, :]

    @triton.jit
    def _bwd_tiles(
        pre_ptr, h_ptr, dout_ptr, dh2_ptr, t0, end, T, f, fm, r, rm, r2, R, R2, s_pre, s_h, s_dout, s_dh2, F,
        BT: tl.constexpr, HALVES: tl.constexpr,
    ):  # fmt: skip
        """The backward's loads for the token tile at ``t0`` (masked from ``end`` or ``T`` on: past the
        chunk they move nothing): fc1's output's gate and up tiles as stored, the incoming gradient's tile,
        ``h``'s tiles and fc2's deferred gradient's (``R2`` = 0: none)."""
        tm, rows, m = _token_tile(t0, end, T, fm, BT)
        hg, hu = _h_tiles(h_ptr, rows, s_h, r, tm[:, None] & rm[None, :], R, HALVES)
        p1 = tl.load(pre_ptr + rows * s_pre + f[None, :], mask=m, other=0.0)
        p2 = tl.load(pre_ptr + rows * s_pre + F + f[None, :], mask=m, other=0.0)
        g = tl.load(dout_ptr + rows * s_dout + f[None, :], mask=m, other=0.0)
        d2 = tl.load(dh2_ptr + rows * s_dh2 + r2[None, :], mask=tm[:, None] & (r2 < R2)[None, :], other=0.0)
        return p1, p2, g, hg, hu, d2

    @triton.jit
    def _bwd_kernel(
        pre_ptr, h_ptr, b_ptr, dout_ptr, dh2_ptr, a2_ptr, dy_ptr, db_ptr, da2_ptr, amax_ptr,
        T, F, R, R2, s_pre, s_h, s_b, s_dout, s_dh2, s_a2, s_dy, S2, TCH: tl.constexpr,
        BT: tl.constexpr, BF: tl.constexpr, BR: tl.constexpr, BR2: tl.constexpr,
        HALVES: tl.constexpr, HAS_FC2: tl.constexpr, DOT_F32: tl.constexpr, AMAX: tl.constexpr,
    ):  # fmt: skip
        """Program (F block, token chunk): SwiGLU's gradient ``dy`` over the chunk, and the chunk's
        partial sums of ``dy.T @ h`` (into ``db`` [chunks, 2F, BR]) and ``S2 * dh2.T @ act`` (into
        ``da2`` [chunks, BR2, F]), all in registers until the end. The chunk length ``TCH`` is a compile-time
        constant (one compilation per token count, which is fixed in training): the Triton 3.6
        interpreter runs no loop with a bound given at run time. With AMAX, the largest |dy| of the
        program's tiles (as rounded) goes to ``amax_ptr`` [chunks * F blocks], as in the forward."""
        f = tl.program_id(0) * BF + tl.arange(0, BF)
        chunk = tl.program_id(1)
        r = tl.arange(0, BR)
        fm, rm = f < F, r < R
        bm = rm[:, None] & fm[None, :]
        bg = tl.load(b_ptr + f[None, :] * s_b + r[:, None], mask=bm, other=0.0)  # [BR, BF]
        bu = tl.load(b_ptr + (f + F)[None, :] * s_b + r[:, None], mask=bm, other=0.0)
        acc_bg = tl.zeros([BF, BR], dtype=tl.float32)
        acc_bu = tl.zeros([BF, BR], dtype=tl.float32)
        r2 = tl.arange(0, BR2)
        if HAS_FC2:
            a2 = tl.load(
                a2_ptr + r2[:, None] * s_a2 + f[None, :], mask=(r2 < R2)[:, None] & fm[None, :], other=0.0
            )
            # fc2's scaling on a2, once: a multiply inside the loop costs the dot its fused accumulate
            # (402 against 276 us per call at the Qwen3-8B shape, H200)
            a2s = (a2.to(tl.float32) * S2).to(a2.dtype)
            acc_a2 = tl.zeros([BR2, BF], dtype=tl.float32)
        dtype = dy_ptr.dtype.element_ty
        if AMAX:  # a running maximum per column: one per tile element made the kernel 57 % slower
            # (459 against 292 us at the Qwen3-8B shape, H100); this one 2 % (298 us)
            acc_mx = tl.zeros([BF], dtype=tl.float32)
        start = chunk * TCH
        # the first token tile's loads; in the loop, each tile's loads are issued before the previous
        # tile's arithmetic: the kernel waited on its loads, and leaving them to the compiler's pipelining
        # (32-token tiles, 3 stages) took 22-39 % longer at the shapes above
        nxt = _bwd_tiles(pre_ptr, h_ptr, dout_ptr, dh2_ptr, start, start + TCH, T, f, fm, r, rm, r2, R, R2,
                         s_pre, s_h, s_dout, s_dh2, F, BT, HALVES)  # fmt: skip
        for t0 in range(0, TCH, BT):
            _, rows, m = _token_tile(start + t0, start + TCH, T, fm, BT)
            p1, p2, g, hg, hu, d2 = nxt
            nxt = _bwd_tiles(pre_ptr, h_ptr, dout_ptr, dh2_ptr, start + t0 + BT, start + TCH, T, f, fm, r, rm,
                             r2, R, R2, s_pre, s_h, s_dout, s_dh2, F, BT, HALVES)  # fmt: skip
            y1 = _preact_half(p1, hg, bg, dtype, DOT_F32)
            y2 = _preact_half(p2, hu, bu, dtype, DOT_F32)
            s = tl.sigmoid(y1)
            g = g.to(tl.float32)
            if HAS_FC2:
                g = (g + _dot(d2, a2s, DOT_F32)).to(dtype).to(tl.float32)  # fc2's input gradient, summed
                act = (y1 * s * y2).to(dtype)  # fc2's input, as the forward made it
                acc_a2 += _dot(tl.trans(d2), act, DOT_F32)
            dyg = (g * s * (1 + y1 * (1 - s)) * y2).to(dtype)
            dyu = (g * y1 * s).to(dtype)
            p = dy_ptr + rows * s_dy + f[None, :]
            tl.store(p, dyg, mask=m)
            tl.store(p + F, dyu, mask=m)
            if AMAX:  # masked entries are 0 (their gradient loads are)
                acc_mx = tl.maximum(acc_mx, tl.max(tl.maximum(tl.abs(dyg), tl.abs(dyu)).to(tl.float32), 0))
            acc_bg += _dot(tl.trans(dyg), hg, DOT_F32)
            acc_bu += _dot(tl.trans(dyu), hu, DOT_F32)
        if AMAX:
            tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + chunk, tl.max(acc_mx, 0))
        part = db_ptr + chunk.to(tl.int64) * 2 * F * BR
        dbm = fm[:, None] & (r < BR)[None, :]
        tl.store(part + f[:, None] * BR + r[None, :], acc_bg, mask=dbm)
        tl.store(part + (f + F)[:, None] * BR + r[None, :], acc_bu, mask=dbm)
        if HAS_FC2:
            part2 = da2_ptr + chunk.to(tl.int64) * BR2 * F
            tl.store(
                part2 + r2[:, None] * F + f[None, :], acc_a2 * S2, mask=(r2 < BR2)[:, None] & fm[None, :]
            )


def _use_triton(*tensors: torch.Tensor | None) -> bool:
    pre = tensors[0]
    return (
        triton is not None
        and pre.is_cuda
        and pre.dtype in (torch.bfloat16, torch.float16)
        and all(x.stride(-1) == 1 for x in tensors if x is not None)
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


SM_REGISTERS = 65536  # per SM on sm_80 and sm_90 (A100, H100, H200)


def _bwd_options(amax: bool) -> dict[str, int]:
    """The backward's launch options: ``BWD_BLOCKS``' warps and stages and, with the amax, a register cap
    that keeps its resident programs per SM. The amax's running maximum took the variant with gate's and up's
    halves and fc2 to 130 registers, so 3 programs per SM and a second wave for the grid that counts on 4;
    capped, 128 without spills. tests/test_lora_swiglu.py compiles every variant for sm_90a and checks that
    it fits."""
    _, _, warps, stages, resident = BWD_BLOCKS
    options = {"num_warps": warps, "num_stages": stages}
    if amax:
        options["maxnreg"] = SM_REGISTERS // (resident * warps * 32)
    return options


def _triton_forward(
    pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor, amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and, with ``amax``, its tiles' largest magnitudes (fp32, one per program)."""
    pre2, h2 = _flat(pre), _flat(h)
    (T, f2), R = pre2.shape, b.shape[1]
    out = pre.new_empty(T, f2 // 2)
    bt, bf, warps = FWD_BLOCKS
    grid = (triton.cdiv(T, bt), triton.cdiv(f2 // 2, bf))
    partials = torch.empty(grid[0] * grid[1], device=pre.device, dtype=torch.float32) if amax else None
    _fwd_kernel[grid](
        pre2, h2, b, out, out if partials is None else partials, T, f2 // 2, R,
        pre2.stride(0), h2.stride(0), b.stride(0), out.stride(0),
        BT=bt, BF=bf, BR=_rank_block(R), HALVES=_halves(h, b), DOT_F32=not pre.is_cuda, AMAX=amax,
        num_warps=warps,
    )  # fmt: skip
    return out.view(*pre.shape[:-1], -1), partials


def _triton_backward(
    dout, pre, h, b, dh2, a2, s2: float = 1.0, amax: bool = False, chunks: int | None = None
) -> tuple:
    """``(dy [T, 2F], b's gradient, a2's gradient or None, dy's partial amaxes or None)``: SwiGLU's
    gradient for fc1's output (fc2's deferred input gradient ``s2 * dh2 @ a2`` included) and the two
    factor gradients, in one kernel plus a sum over the token chunks' partial factor gradients; with
    ``amax``, the largest |dy| of each program (fp32). ``chunks``: the number of token chunks the grid
    takes instead of filling ``BWD_BLOCKS``' resident programs per SM (bench/swiglu_backward.py sweeps it)."""
    pre2, h2, g2 = _flat(pre), _flat(h), _flat(dout.contiguous())
    (T, f2), R = pre2.shape, b.shape[1]
    ffn = f2 // 2
    bt, bf, _, _, resident = BWD_BLOCKS
    fc2 = dh2 is not None
    d2 = _flat(dh2) if fc2 else h2
    a = a2 if fc2 else b
    br, br2 = _rank_block(R), _rank_block(a.shape[0] if fc2 else 16)
    blocks = triton.cdiv(ffn, bf)
    # token chunks: as many as fill the ``resident`` program slots per SM once (the interpreter: a few),
    # each chunk whole token blocks
    if chunks is None:
        sms = _sm_count(pre.device) if pre.is_cuda else 2
        chunks = resident * sms // blocks
    chunks = max(1, min(triton.cdiv(T, bt), chunks))
    tch = triton.cdiv(triton.cdiv(T, chunks), bt) * bt
    chunks = triton.cdiv(T, tch)
    dy = torch.empty_like(pre2, memory_format=torch.contiguous_format)
    db = torch.empty(chunks, f2, br, device=pre.device, dtype=torch.float32)
    da2 = torch.empty(chunks, br2, ffn, device=pre.device, dtype=torch.float32) if fc2 else db
    partials = torch.empty(blocks * chunks, device=pre.device, dtype=torch.float32) if amax else None
    _bwd_kernel[(blocks, chunks)](
        pre2, h2, b, g2, d2, a, dy, db, da2, db if partials is None else partials, T, ffn, R, a.shape[0] if fc2 else 0,
        pre2.stride(0), h2.stride(0), b.stride(0), g2.stride(0), d2.stride(0), a.stride(0), dy.stride(0),
        float(s2), TCH=tch, BT=bt, BF=bf, BR=br, BR2=br2, HALVES=_halves(h, b), HAS_FC2=fc2, DOT_F32=not pre.is_cuda,
        AMAX=amax, **_bwd_options(amax),
    )  # fmt: skip
    d_b = db.sum(0)[:, :R].to(b.dtype)
    d_a2 = da2.sum(0)[: a2.shape[0]].to(a2.dtype) if fc2 else None
    return dy, d_b, d_a2, partials


def _reference_backward(dout, pre, h, b, dh2, a2, s2: float = 1.0, amax: bool = False) -> tuple:
    """The same as :func:`_triton_backward` with torch ops (materialising the sums; ``amax``: dy's
    largest magnitude as the one partial)."""
    y = _preact_ref(pre, h, b)
    g = _flat(dout)
    d_a2 = None
    if dh2 is not None:
        g = torch.addmm(g.float(), _flat(dh2).float(), a2.float(), alpha=s2).to(g.dtype)
        d2, act = _flat(dh2).t(), _swiglu_ref(y)
        d_a2 = torch.addmm(a2.new_empty(a2.shape), d2, act, beta=0, alpha=s2) if s2 != 1.0 else d2 @ act
    dy = _swiglu_back_ref(g, y)
    d_b = dy.t() @ _flat(h)
    if _halves(h, b):  # the gradient of the blocks of _block_b that are b's
        f, r = b.shape[0] // 2, b.shape[1]
        d_b = torch.cat([d_b[:f, :r], d_b[f:, r:]])
    return dy, d_b, d_a2, dy.abs().amax().float().view(1) if amax else None


def _h_grad(dy: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dy @ b`` [T, width of h] for SwiGLU's gradient ``dy`` [T, 2F]: with halves, gate's half of ``dy``
    meets gate's rows of ``b`` and up's up's (one batched GEMM), not a block matrix with zeros."""
    if not _halves(h, b):
        return dy @ b
    f, r = b.shape[0] // 2, b.shape[1]
    halves = torch.bmm(dy.view(-1, 2, f).transpose(0, 1), b.view(2, f, r))  # [2, T, R]
    return halves.transpose(0, 1).reshape(-1, 2 * r)


def _check(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> None:
    widths = (b.shape[-1], 2 * b.shape[-1])
    if (
        pre.shape[-1] % 2
        or b.shape[0] != pre.shape[-1]
        or h.shape[-1] not in widths
        or pre.shape[:-1] != h.shape[:-1]
    ):
        raise ValueError(
            f"swiglu_lora: shapes pre {tuple(pre.shape)}, h {tuple(h.shape)}, b {tuple(b.shape)}"
        )
    if h.dtype != pre.dtype or b.dtype != pre.dtype:
        raise ValueError(f"swiglu_lora: dtypes pre {pre.dtype}, h {h.dtype}, b {b.dtype} differ")


def swiglu_lora_forward(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``swiglu(pre + h @ b.T)`` without autograd: bit-identical to :func:`swiglu_lora`'s output (same
    kernel, no atomics), for recomputing that output in a backward."""
    _check(pre, h, b)
    return _forward(pre, h, b)[0]


def _forward(
    pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor, amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        if _use_triton(pre, h, b):
            return _triton_forward(pre, h, b, amax)
        out = _swiglu_ref(_preact_ref(pre, h, b)).view(*pre.shape[:-1], -1)
        return out, out.abs().amax().float().view(1) if amax else None


class SwigluLora(torch.autograd.Function):
    """``swiglu(pre + h @ b.T)``; saves the inputs (not the [T, 2F] sum) and recomputes the sum. With
    ``a2`` and a deferred ``link`` from fc2's A GEMM (scaling ``s2``), its backward also adds fc2's
    adapter input gradient ``s2 * dh2 @ a2`` and returns ``a2``'s gradient ``s2 * dh2.T @ out``. With
    ``fp8`` (:class:`~twinkle_specs.lora.fp8_amax.SwigluFp8`) the kernels also take the amax of the
    output (left in ``fp8.input_amax``) and of the gradient, which then goes to fc1 as TE's FP8 tensor."""

    @staticmethod
    def forward(ctx, pre, h, b, a2, link, fp8):
        _check(pre, h, b)
        ctx.save_for_backward(pre, h, b, a2)
        ctx.link, ctx.fp8 = link, fp8
        out, amax = _forward(pre, h, b, amax=fp8 is not None and fp8.input is not None)
        if amax is not None:
            fp8.input_amax = amax
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pre, h, b, a2 = ctx.saved_tensors
        link, dh2, s2 = ctx.link, None, 1.0
        if link is not None:
            dh2, s2, link.dh, link.a = link.dh, link.scale, None, None
        backward = _triton_backward if _use_triton(pre, h, b, dh2, a2) else _reference_backward
        need, cast = ctx.needs_input_grad, ctx.fp8.grad if ctx.fp8 is not None else None
        amax = need[0] and cast is not None
        dy, d_b, d_a2, partials = backward(dout, pre, h, b, dh2, a2 if dh2 is not None else None, s2, amax)
        d_pre = None
        if need[0]:
            d_pre = cast(dy.view(pre.shape), partials) if amax else dy.view(pre.shape)
        return (
            d_pre,
            _h_grad(dy, b, h).view(h.shape) if need[1] else None,
            d_b if need[2] else None,
            d_a2 if need[3] else None,
            None,
            None,
        )


def swiglu_lora(
    pre: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    a2: torch.Tensor | None = None,
    link: GradLink | None = None,
    fp8: SwigluFp8 | None = None,
) -> torch.Tensor:
    """``swiglu(pre + h @ b.T)`` for pre [..., 2F] (gate | up), h [..., R] or [..., 2R] (halves, see the
    module docstring), b [2F, R], one dtype; ``a2``
    [R2, F] and ``link``: fc2's A and the deferred link of its A GEMM (see the module docstring); ``fp8``:
    the FP8 casts whose amax the kernels take (see :class:`SwigluLora`)."""
    return SwigluLora.apply(pre, h, b, a2, link, fp8)
