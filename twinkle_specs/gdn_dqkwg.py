"""fla's gated ``chunk_bwd_dqkwg`` in torch, for the Hopper GPUs where fla refuses its own.

flash-linear-attention 0.6 raises in one backward kernel of its chunked gated delta rule (``chunk_bwd_dqkwg``
with a gate) on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (Triton miscompiles it there; torch 2.11 ships
Triton 3.6), unless tilelang is installed. Every other kernel of the rule is fine. This module computes that
one step with batched matmuls over all chunks (the same arithmetic as fla's Triton kernel, in fp32 with the
products on TF32 tensor cores; rows of whole chunks as views, others gathered chunk by chunk) and offers
it to fla as a backend of its ``common`` operations, so that training keeps fla's kernels for the rest instead
of falling back to the far slower torch reference of the whole rule.

Nothing happens at import: :func:`enable` registers the backend (with fla's own ``register``), and
:mod:`twinkle_specs.gdn` calls it only where fla would otherwise refuse. From then on, in that process, fla's
gated ``chunk_bwd_dqkwg`` runs here for every caller (it would have raised for them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch


@contextlib.contextmanager
def _tf32_matmuls():
    """fp32 matrix products on TF32 tensor cores while inside (on CUDA; the CPU ignores it), as fla's kernel
    runs its dots on tensor cores (with bf16 inputs, coarser than TF32) where full fp32 products run on the
    CUDA cores, several times slower. The process's own setting comes back on the way out. torch's
    ``fp32_precision`` API: the legacy ``allow_tf32`` raises once a process has set TF32 the new way, while
    this one reads and restores either (checked in tests/test_gdn_dqkwg.py)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


@_tf32_matmuls()
def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """dq, dk, dw, dg of one chunked gated delta rule backward, as fla's ``chunk_bwd_dqkwg`` returns them.

    q, k: [B, T, H, K]; v (the rule's v_new), do, dv: [B, T, HV, V]; w: [B, T, HV, K]; h, dh: the chunk
    states [B, NT, HV, K, V] ([.., V, K] with ``state_v_first``); g: [B, T, HV], the in-chunk cumulative
    gate in base 2 (fla's convention). Packed sequences as fla packs them: B = 1, ``cu_seqlens`` [N + 1],
    each sequence chunked from its own start, the chunks of all sequences in order along h's chunk axis
    (``chunk_indices`` [NT, 2]: sequence, chunk within it). Returns dq, dk [B, T, H, K] (summed over the
    value heads of a key head), dw (negated, as fla stores it) and dg [B, T, HV] in fp32, before fla's
    reverse cumsum.
    """
    if why := unsupported(g, g_gamma):
        raise NotImplementedError(why)
    B, T, H, K = k.shape
    HV, BT = v.shape[2], chunk_size
    scale = K**-0.5 if scale is None else scale
    start, length = _chunk_table(B, T, BT, cu_seqlens, chunk_indices, q.device)
    offset = torch.arange(BT, device=q.device)
    valid = offset < length[:, None]  # [NC, BT]
    # fixed-length rows of whole chunks: every chunk is a plain slice of the tokens, no gather, nothing to zero
    aligned = cu_seqlens is None and T % BT == 0
    if not aligned:  # each chunk's tokens, past its end its last real token again (zeroed, but for the gate)
        index = (start[:, None] + torch.minimum(offset, length[:, None] - 1)).clamp(0, B * T - 1)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """[B, T, heads, d] -> [heads, NC, BT, d] in fp32, zero past each chunk's end."""
        if aligned:
            return x.float().reshape(-1, BT, *x.shape[2:]).movedim(2, 0)
        x = x.float().flatten(0, 1)[index]
        return torch.where(valid[:, :, None, None], x, 0).movedim(2, 0)

    group = HV // H
    qc = chunks(q).repeat_interleave(group, dim=0)  # [HV, NC, BT, K]
    kc = chunks(k).repeat_interleave(group, dim=0)
    vc, doc = chunks(v), chunks(do)
    # [HV, NC, BT]; past a chunk's end, its last real gate
    gc = (g.float().reshape(-1, BT, HV) if aligned else g.float().flatten(0, 1)[index]).movedim(2, 0)
    # states as [HV, NC, K, V]
    hs, dhs = (s.float().flatten(0, 1).movedim(1, 0) for s in (h, dh))
    if state_v_first:
        hs, dhs = hs.transpose(-1, -2), dhs.transpose(-1, -2)

    g_last = gc[..., -1:]  # [HV, NC, 1]
    dg_last = (hs * dhs).sum((-1, -2)) * g_last.squeeze(-1).exp2()  # [HV, NC]
    dq = doc @ hs.transpose(-1, -2) * (gc.exp2() * scale).unsqueeze(-1)
    dk = vc @ dhs.transpose(-1, -2) * torch.where(valid, (g_last - gc).exp2(), 0).unsqueeze(-1)
    dg_last = dg_last + (dk * kc).sum((-1, -2))
    causal = (
        torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril() & valid[:, :, None] & valid[:, None, :]
    )
    ds = doc @ vc.transpose(-1, -2) * (gc.unsqueeze(-1) - gc.unsqueeze(-2)).exp2()
    ds = torch.where(causal, ds, 0) * scale
    ds = ds.to(k.dtype).float()  # fla's kernel rounds ds to the inputs' dtype before its two GEMMs
    dq = dq + ds @ kc
    dk = dk + ds.transpose(-1, -2) @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [HV, NC, BT]
    # each chunk's last real position takes the gradient of the chunk's last gate
    dg = dg + torch.where(offset == length[:, None] - 1, dg_last.unsqueeze(-1), 0)

    if not aligned:  # every token's place among the chunks' positions. Fixed-length, or packed with fla's
        # chunk table: no host copy anywhere here (CUDA graphs capture this); a table built here asks the host
        # for its length.
        token = torch.arange(B * T, device=q.device)
        chunk = torch.searchsorted(start, token, right=True) - 1
        place = chunk * BT + token - start[chunk]

    def tokens(x: torch.Tensor) -> torch.Tensor:
        """[heads, NC, BT, d] -> [B, T, heads, d], contiguous: fla's kernels read the results by pointer"""
        if aligned:
            return x.movedim(0, 2).reshape(B, T, x.shape[0], x.shape[-1]).contiguous()
        return x.movedim(0, 2).flatten(0, 1)[place].view(B, T, x.shape[0], x.shape[-1])

    dq, dk = tokens(dq), tokens(dk)  # [B, T, HV, K]
    if group > 1:
        dq, dk = dq.view(B, T, H, group, K).sum(3), dk.view(B, T, H, group, K).sum(3)
    dw = None if w is None else -tokens(chunks(dv) @ hs.transpose(-1, -2)).to(w.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dw, tokens(dg.unsqueeze(-1)).squeeze(-1)


def _chunk_table(
    B: int,
    T: int,
    BT: int,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's first token (an index into the B * T tokens, ascending) and its length, in the order of
    h's chunk axis. Packed: from fla's ``chunk_indices`` (built here where fla gave none); rows fla marks
    unused (sequence -1, a graph-captured table) get length 0 and start past the last token."""
    if cu_seqlens is None:
        first = torch.arange(0, T, BT, device=device)
        start = (torch.arange(B, device=device)[:, None] * T + first).flatten()
        return start, (T - first).clamp(max=BT).repeat(B)
    if B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) come as one row, B = 1, not {B}")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if chunk_indices is None:
        counts = -(-(cu[1:] - cu[:-1]) // BT)
        sequence = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
        first_chunk = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        chunk_indices = torch.stack([sequence, torch.arange(len(sequence), device=device) - first_chunk], 1)
    sequence, within = chunk_indices.to(device=device, dtype=torch.long).unbind(-1)
    used = sequence >= 0
    sequence = sequence.clamp(min=0)
    start = torch.where(used, cu[sequence] + within * BT, T)
    return start, torch.where(used, (cu[sequence + 1] - start).clamp(max=BT), 0)


def unsupported(g, g_gamma) -> str | None:
    """Why :func:`chunk_bwd_dqkwg` cannot take a call (fla's own kernel then runs), else None."""
    if g is None or g_gamma is not None:
        return "twinkle_specs' chunk_bwd_dqkwg: the gated case only (a g, no g_gamma)"
    return None


@functools.cache
def enable() -> None:
    """Offer :func:`chunk_bwd_dqkwg` to fla as a backend of its ``common`` operations (once per process),
    after every backend fla ships (a lower priority): fla calls it for the gated case (fixed-length or
    packed), the one it refuses on Hopper with Triton < 3.7.1, and keeps its own kernel for the others."""
    from fla.backends import BaseBackend, register

    signature = inspect.signature(chunk_bwd_dqkwg)  # fla's own, which this function keeps

    @register("common")
    class TwinkleTorchBackend(BaseBackend):
        backend_type = "twinkle_specs_torch"
        priority = 9

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            call = signature.bind(*args, **kwargs).arguments
            why = unsupported(call.get("g"), call.get("g_gamma"))
            return why is None, why

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)
