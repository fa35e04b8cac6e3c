"""``out_i += h_i @ M_e`` in place for every row ``i`` of expert ``e``'s token block: the routed adapters'
rank-r GEMMs accumulating into the frozen base's grouped GEMM output (forward: ``M_e = B_eᵀ``) and into
its input gradient (backward: ``M_e = A_e``).

torch's grouped GEMM cannot accumulate into an existing tensor, so the unfused adapter writes its
full-size product and a second kernel adds it: at Qwen3-30B-A3B (32,768 routed rows, fc1 1,536 wide,
fc2 2,048) that is ~0.8 GB of extra memory traffic per layer and step. Here each output tile is read,
gets its rank-r product from the small ``h`` and ``M_e`` tiles, and is written once; the sum is taken in
fp32 and rounded once (as a cuBLAS beta = 1 epilogue does).

The token blocks' ends stay on the GPU (``ends``, int32, as torch's grouped GEMM takes them): each
program finds its expert and rows from them, so nothing waits for the host and the kernel can be
captured in a CUDA graph. Programs are laid out per expert, ``cdiv(count_e, BM)`` row tiles each, in a
grid sized for the worst case (``cdiv(rows, BM) + experts``); the spare programs store nothing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU tensors and machines without Triton
    triton = None

# Fixed launch configuration (autotuning would have to finish before CUDA-graph capture): rows per
# tile, columns per tile, warps. Swept on an H200 at Qwen3-30B-A3B's and Qwen3.5-35B-A3B's expert
# widths (bench/grouped_experts.py): no other tile beat this one at every width or in two runs (the
# best per width 0-20 % faster, a different one each run); 128-row or 256-column tiles with 8 warps were
# up to 2x slower, rank-1 updates instead of tl.dot 3-5x slower.
BLOCKS = (64, 128, 4)

if triton is not None:

    @triton.jit
    def _add_kernel(
        out_ptr, h_ptr, m_ptr, ends_ptr, N, R, E, s_out, s_h, s_me, s_mr, s_mn,
        BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Program (row tile, column tile): the row tile's expert is the one whose tiles, counted in
        expert order, cover ``program_id(0)``; a program past the last tile finds none and is all masked.
        DOT_F32 (fp32 tensors, and CPU tensors, i.e. the Triton interpreter, whose 3.6 ``tl.dot``
        multiplies bf16 bit patterns as integers) takes the products in full fp32."""
        p = tl.program_id(0)
        idx = tl.arange(0, BE)
        em = idx < E
        ends = tl.load(ends_ptr + idx, mask=em, other=0)
        starts = tl.load(ends_ptr + idx - 1, mask=em & (idx > 0), other=0)
        tiles = tl.where(em, (ends - starts + BM - 1) // BM, 0)
        covered = tl.cumsum(tiles, 0)  # tiles of experts 0..e
        e = tl.sum((covered <= p).to(tl.int32), 0)
        mine = idx == e  # all false past the last tile
        first_tile = tl.sum(tl.where(mine, covered - tiles, 0), 0)
        row_end = tl.sum(tl.where(mine, ends, 0), 0)
        rows = tl.sum(tl.where(mine, starts, 0), 0) + (p - first_tile) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        r = tl.arange(0, BR)
        rm, cm, rk = rows < row_end, cols < N, r < R
        rows64 = rows.to(tl.int64)[:, None]
        h = tl.load(h_ptr + rows64 * s_h + r[None, :], mask=rm[:, None] & rk[None, :], other=0.0)
        m = tl.load(
            m_ptr + e.to(tl.int64) * s_me + r[:, None] * s_mr + cols[None, :] * s_mn,
            mask=(e < E) & rk[:, None] & cm[None, :],
            other=0.0,
        )
        if DOT_F32:
            acc = tl.dot(h.to(tl.float32), m.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(h, m)
        o = out_ptr + rows64 * s_out + cols[None, :]
        om = rm[:, None] & cm[None, :]
        total = tl.load(o, mask=om, other=0.0).to(tl.float32) + acc
        tl.store(o, total.to(out_ptr.dtype.element_ty), mask=om)


def _triton_add_(out: torch.Tensor, h: torch.Tensor, m: torch.Tensor, ends: torch.Tensor) -> None:
    (rows, n), (experts, r) = out.shape, m.shape[:2]
    bm, bn, warps = BLOCKS
    grid = (triton.cdiv(rows, bm) + experts, triton.cdiv(n, bn))
    _add_kernel[grid](
        out, h, m, ends, n, r, experts, out.stride(0), h.stride(0), *m.stride(),
        BM=bm, BN=bn, BR=max(16, triton.next_power_of_2(r)), BE=triton.next_power_of_2(experts),
        DOT_F32=not out.is_cuda or out.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip


def _reference_add_(out: torch.Tensor, h: torch.Tensor, m: torch.Tensor, ends: torch.Tensor) -> None:
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            block = out[start:end].float() + h[start:end].float() @ m[e].float()
            out[start:end] = block.to(out.dtype)
        start = end


def grouped_low_rank_add_(out: torch.Tensor, h: torch.Tensor, m: torch.Tensor, ends: torch.Tensor) -> None:
    """``out[i] += h[i] @ m[e]`` in place for the rows ``i`` of expert ``e``'s block (``ends``: the blocks'
    ends, int32, the last one ``out``'s row count), for ``out`` [rows, N], ``h`` [rows, R] and ``m`` [E, R,
    N] (any strides; a transpose of ``b`` [E, N, R] is read where it is). Triton on CUDA; the same sum,
    one expert at a time, for CPU tensors."""
    if out.shape[0] != h.shape[0] or h.shape[1] != m.shape[1] or out.shape[1] != m.shape[2]:
        raise ValueError(
            f"grouped_low_rank_add_: shapes out {tuple(out.shape)}, h {tuple(h.shape)}, m {tuple(m.shape)}"
        )
    if ends.shape != (m.shape[0],) or out.stride(1) != 1 or h.stride(1) != 1:
        raise ValueError(
            f"grouped_low_rank_add_: ends {tuple(ends.shape)} for {m.shape[0]} experts, "
            f"strides out {out.stride()}, h {h.stride()} (rows must be contiguous)"
        )
    if triton is not None and out.is_cuda:
        _triton_add_(out, h, m, ends)
    else:
        _reference_add_(out, h, m, ends)
