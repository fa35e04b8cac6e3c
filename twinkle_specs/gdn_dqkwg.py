"""fla's gated ``chunk_bwd_dqkwg`` in torch, for the Hopper GPUs where fla refuses its own.

flash-linear-attention 0.6 raises in one backward kernel of its chunked gated delta rule (``chunk_bwd_dqkwg``
with a gate) on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (Triton miscompiles it there; torch 2.11 ships
Triton 3.6), unless tilelang is installed. Every other kernel of the rule is fine. This module computes that
one step with batched matmuls over all chunks (the same arithmetic as fla's Triton kernel, in fp32) and offers
it to fla as a backend of its ``common`` operations, so that training keeps fla's kernels for the rest instead
of falling back to the far slower torch reference of the whole rule.

Nothing happens at import: :func:`enable` registers the backend (with fla's own ``register``), and
:mod:`twinkle_specs.gdn` calls it only where fla would otherwise refuse. From then on, in that process, fla's
gated ``chunk_bwd_dqkwg`` runs here for every caller (it would have raised for them).
"""

from __future__ import annotations

import functools
import inspect

import torch


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
    gate in base 2 (fla's convention). Returns dq, dk [B, T, H, K] (summed over the value heads of a key
    head), dw (negated, as fla stores it) and dg [B, T, HV] in fp32, before fla's reverse cumsum.
    """
    if why := unsupported(g, g_gamma, cu_seqlens):
        raise NotImplementedError(why)
    B, T, H, K = k.shape
    HV, BT = v.shape[2], chunk_size
    NT = -(-T // BT)
    pad = NT * BT - T
    scale = K**-0.5 if scale is None else scale

    def chunks(x: torch.Tensor, fill: str = "zero") -> torch.Tensor:
        """[B, T, heads, d] -> [B, heads, NT, BT, d] in fp32, T padded to whole chunks."""
        x = x.float()
        if pad:
            tail = (
                x[:, -1:].expand(-1, pad, *x.shape[2:])
                if fill == "last"
                else x.new_zeros(B, pad, *x.shape[2:])
            )
            x = torch.cat([x, tail], dim=1)
        return x.view(B, NT, BT, *x.shape[2:]).movedim(3, 1)

    group = HV // H
    qc = chunks(q).repeat_interleave(group, dim=1)  # [B, HV, NT, BT, K]
    kc = chunks(k).repeat_interleave(group, dim=1)
    vc, doc = chunks(v), chunks(do)
    gc = chunks(g.unsqueeze(-1), fill="last").squeeze(-1)  # [B, HV, NT, BT]
    # states as [B, HV, NT, K, V]
    hs, dhs = (s.float().movedim(2, 1) for s in (h, dh))
    if state_v_first:
        hs, dhs = hs.transpose(-1, -2), dhs.transpose(-1, -2)

    g_last = gc[..., -1:]  # [B, HV, NT, 1]; padding repeats the last real gate
    pos = torch.arange(NT * BT, device=q.device).view(NT, BT)  # token positions, built on the device
    valid = pos < T
    dg_last = (hs * dhs).sum((-1, -2)) * g_last.squeeze(-1).exp2()  # [B, HV, NT]
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
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [B, HV, NT, BT]
    # each chunk's last real position takes the gradient of the chunk's last gate (dg_last); also the padded
    # end of a partial last chunk, which is cut below. No host copy anywhere here (CUDA graphs capture this).
    dg = dg + torch.where((pos % BT == BT - 1) | (pos == T - 1), dg_last.unsqueeze(-1), 0)

    def tokens(x: torch.Tensor) -> torch.Tensor:
        """[B, heads, NT, BT, d] -> [B, T, heads, d]"""
        return x.movedim(1, 3).reshape(B, NT * BT, x.shape[1], x.shape[-1])[:, :T].contiguous()

    dq, dk = tokens(dq), tokens(dk)  # [B, T, HV, K]
    if group > 1:
        dq, dk = dq.view(B, T, H, group, K).sum(3), dk.view(B, T, H, group, K).sum(3)
    dw = None if w is None else -tokens(chunks(dv) @ hs.transpose(-1, -2)).to(w.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dw, tokens(dg.unsqueeze(-1)).squeeze(-1)


def unsupported(g, g_gamma, cu_seqlens) -> str | None:
    """Why :func:`chunk_bwd_dqkwg` cannot take a call (fla's own kernel then runs), else None."""
    if g is None or g_gamma is not None:
        return "twinkle_specs' chunk_bwd_dqkwg: the gated, fixed-length case only (a g, no g_gamma)"
    if cu_seqlens is not None:
        return "twinkle_specs' chunk_bwd_dqkwg: the gated, fixed-length case only (no cu_seqlens)"
    return None


@functools.cache
def enable() -> None:
    """Offer :func:`chunk_bwd_dqkwg` to fla as a backend of its ``common`` operations (once per process),
    after every backend fla ships (a lower priority): fla calls it for the gated, fixed-length case, which
    is the one it refuses on Hopper with Triton < 3.7.1, and keeps its own kernel for everything else."""
    from fla.backends import BaseBackend, register

    @register("common")
    class TwinkleTorchBackend(BaseBackend):
        backend_type = "twinkle_specs_torch"
        priority = 9

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            call = inspect.signature(chunk_bwd_dqkwg).bind(*args, **kwargs).arguments
            why = unsupported(call.get("g"), call.get("g_gamma"), call.get("cu_seqlens"))
            return why is None, why

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)
