"""twinkle_specs.gdn_dqkwg: fla's gated ``chunk_bwd_dqkwg`` in torch. On CPU: the batched implementation
against a chunk-by-chunk, head-by-head transcription of fla 0.6's Triton kernel (``chunk_bwd_kernel_dqkwg``
and its wrapper), and its registration as an fla backend (a stand-in for ``fla.backends``). The whole rule's
gradients against megatron-core's torch reference need fla's other kernels: tests/test_hybrid_gpu.py."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from twinkle_specs import gdn_dqkwg


def kernel_transcription(q, k, v, do, h, dh, w, g, dv, scale, state_v_first, BT):
    """fla's kernel one (batch, value head, chunk) program at a time, fp32, as its Triton source reads."""
    B, T, H, K = k.shape
    HV = v.shape[2]
    NT = -(-T // BT)
    dq = torch.zeros(B, T, HV, K)
    dk = torch.zeros(B, T, HV, K)
    dw = torch.zeros(B, T, HV, K)
    dg = torch.zeros(B, T, HV)
    for b in range(B):
        for i_h in range(HV):
            kh = i_h // (HV // H)
            for c in range(NT):
                t0, t1 = c * BT, min(c * BT + BT, T)
                hc, dhc = h[b, c, i_h].float(), dh[b, c, i_h].float()
                if state_v_first:  # [V, K] -> [K, V]
                    hc, dhc = hc.T, dhc.T
                vc, doc, dvc = v[b, t0:t1, i_h].float(), do[b, t0:t1, i_h].float(), dv[b, t0:t1, i_h].float()
                qc, kc = q[b, t0:t1, kh].float(), k[b, t0:t1, kh].float()
                gc = g[b, t0:t1, i_h].float()
                g_last = gc[-1]
                dg_last = (hc * dhc).sum()
                ds = doc @ vc.T
                bdq = doc @ hc.T
                bdk = vc @ dhc.T
                dw[b, t0:t1, i_h] = -(dvc @ hc.T)
                dg_last = dg_last * torch.exp2(g_last)
                bdq = bdq * torch.exp2(gc)[:, None] * scale
                bdk = bdk * torch.exp2(g_last - gc)[:, None]
                dg_last = dg_last + (bdk * kc).sum()
                ds = torch.tril(ds * torch.exp2(gc[:, None] - gc[None, :])) * scale
                ds = ds.to(k.dtype).float()
                bdq = bdq + ds @ kc
                bdk = bdk + ds.T @ qc
                bdg = (bdq * qc).sum(1) - (bdk * kc).sum(1)
                bdg[-1] += dg_last
                dq[b, t0:t1, i_h], dk[b, t0:t1, i_h], dg[b, t0:t1, i_h] = bdq, bdk, bdg
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dw, dg


@pytest.mark.parametrize("T", [96, 100])  # whole chunks; a partial last chunk
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_dqkwg_equals_the_kernel_chunk_by_chunk(T, state_v_first, dtype):
    torch.manual_seed(0)
    B, H, HV, K, V, BT = 2, 2, 4, 8, 16, 32
    NT = -(-T // BT)
    q, k = (torch.randn(B, T, H, K, dtype=dtype) for _ in range(2))
    v, do, dv = (torch.randn(B, T, HV, V, dtype=dtype) for _ in range(3))
    w = torch.randn(B, T, HV, K, dtype=dtype)
    shape = (B, NT, HV, V, K) if state_v_first else (B, NT, HV, K, V)
    h, dh = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    # the in-chunk cumulative log2 decay, as fla's forward leaves it
    g = (-torch.rand(B, T, HV) * 0.3).view(B, -1, HV)
    g = torch.cat([c.cumsum(1) for c in g.split(BT, dim=1)], dim=1)
    args = dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, scale=K**-0.5, state_v_first=state_v_first)

    got = gdn_dqkwg.chunk_bwd_dqkwg(**args, chunk_size=BT)
    want = kernel_transcription(**args, BT=BT)
    assert [t.dtype for t in got] == [dtype, dtype, dtype, torch.float32]
    assert [t.shape for t in got] == [q.shape, k.shape, w.shape, g.shape]
    # fla's kernels read the results by pointer, as contiguous tensors (a strided view was wrong on the GPU)
    assert all(t.is_contiguous() for t in got), [t.stride() for t in got]
    # fp32: the same sums in another order; bf16: the outputs' own rounding (one bf16 ulp, 2^-8 relative)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want, strict=True):
        scale = b.abs().max()
        assert (a.float() - b.to(dtype).float()).abs().max() <= rtol * scale, name


def _packed(lengths: list[int], BT: int, state_v_first: bool, dtype: torch.dtype) -> dict:
    """One row of packed sequences as fla's varlen backward hands it over: the gate cumulated within each
    sequence's own chunks, one state per chunk of each sequence, in order."""
    H, HV, K, V = 2, 4, 8, 16
    T = sum(lengths)
    NT = sum(-(-n // BT) for n in lengths)
    q, k = (torch.randn(1, T, H, K, dtype=dtype) for _ in range(2))
    v, do, dv = (torch.randn(1, T, HV, V, dtype=dtype) for _ in range(3))
    shape = (1, NT, HV, V, K) if state_v_first else (1, NT, HV, K, V)
    g = [c.cumsum(1) for n in lengths for c in (-torch.rand(1, n, HV) * 0.3).split(BT, dim=1)]
    return dict(
        q=q, k=k, v=v, do=do, dv=dv, w=torch.randn(1, T, HV, K, dtype=dtype), g=torch.cat(g, dim=1),
        h=torch.randn(shape, dtype=dtype), dh=torch.randn(shape, dtype=dtype), scale=K**-0.5,
        state_v_first=state_v_first,
    )  # fmt: skip


def _each_sequence(args: dict, lengths: list[int], BT: int) -> list[torch.Tensor]:
    """The transcription of fla's kernel on each sequence alone, concatenated along the tokens."""
    parts, t0, c0 = [], 0, 0
    for n in lengths:
        nc = -(-n // BT)
        one = {
            name: x[:, c0 : c0 + nc]
            if name in ("h", "dh")
            else x[:, t0 : t0 + n]
            if torch.is_tensor(x)
            else x
            for name, x in args.items()
        }
        parts.append(kernel_transcription(**one, BT=BT))
        t0, c0 = t0 + n, c0 + nc
    return [torch.cat(x, dim=1) for x in zip(*parts, strict=True)]


@pytest.mark.parametrize("chunk_indices", ["given", "built here", "with unused rows"])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_sequences_equal_each_sequence_alone(chunk_indices, state_v_first, dtype):
    """cu_seqlens (fla's varlen backward): every sequence's gradients equal the kernel's on that sequence
    alone; sequences shorter than a chunk, of whole chunks, and ending mid-chunk; a row of one token."""
    torch.manual_seed(0)
    lengths, BT = [37, 64, 1, 90, 8], 32
    args = _packed(lengths, BT, state_v_first, dtype)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    table = [(n, c) for n, length in enumerate(lengths) for c in range(-(-length // BT))]
    if chunk_indices == "with unused rows":  # fla's graph-captured tables: fixed rows, unused ones marked -1
        table += [(-1, -1)] * 2
        for name in ("h", "dh"):
            args[name] = torch.cat([args[name], torch.randn_like(args[name][:, :2])], dim=1)
    indices = None if chunk_indices == "built here" else torch.tensor(table)

    got = gdn_dqkwg.chunk_bwd_dqkwg(**args, cu_seqlens=cu, chunk_size=BT, chunk_indices=indices)
    if chunk_indices == "with unused rows":
        args["h"], args["dh"] = args["h"][:, :-2], args["dh"][:, :-2]
    want = _each_sequence(args, lengths, BT)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert (a.float() - b.to(a.dtype).float()).abs().max() <= rtol * b.abs().max(), name


def test_packed_sequences_come_as_one_row():
    x, g = torch.zeros(2, 64, 1, 8), torch.zeros(2, 64, 1)
    with pytest.raises(ValueError, match="one row, B = 1, not 2"):
        gdn_dqkwg.chunk_bwd_dqkwg(x, x, x, x, x, x, g=g, cu_seqlens=torch.tensor([0, 64]))


def test_the_ungated_case_is_fla_s_own():
    x = torch.zeros(1, 64, 1, 8)
    with pytest.raises(NotImplementedError, match="the gated case only"):
        gdn_dqkwg.chunk_bwd_dqkwg(x, x, x, x, x, x, g=None)


def test_enable_registers_one_backend_for_the_gated_case(monkeypatch):
    """``enable`` adds one backend to fla's ``common`` registry, after fla's own (a larger priority), whose
    verifier takes the gated calls (fixed-length or packed) only; a second call changes nothing."""
    registered = []

    class BaseBackend:
        pass

    def register(operation):
        def add(cls):
            registered.append((operation, cls()))
            return cls

        return add

    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(
        sys.modules, "fla.backends", types.SimpleNamespace(BaseBackend=BaseBackend, register=register)
    )
    gdn_dqkwg.enable.cache_clear()
    try:
        gdn_dqkwg.enable()
        gdn_dqkwg.enable()
    finally:
        gdn_dqkwg.enable.cache_clear()
    assert len(registered) == 1
    operation, backend = registered[0]
    assert operation == "common" and backend.priority > 5  # fla's backends default to 5
    x, g = torch.zeros(1, 64, 1, 8), torch.zeros(1, 64, 1)
    assert backend.chunk_bwd_dqkwg_verifier(x, x, x, x, x, x, g=g) == (True, None)
    assert not backend.chunk_bwd_dqkwg_verifier(x, x, x, x, x, x, g=None)[0]
    assert backend.chunk_bwd_dqkwg_verifier(x, x, x, x, x, x, None, g, cu_seqlens=torch.tensor([0, 64]))[0]
    assert not backend.chunk_bwd_dqkwg_verifier(x, x, x, x, x, x, None, g, torch.ones(1))[0]  # g_gamma


@pytest.mark.parametrize("before", ["none", "ieee", "tf32"])
def test_products_run_on_tf32_inside_and_the_process_setting_comes_back(before, monkeypatch):
    """fp32 products on TF32 tensor cores during the call only (the CPU ignores the flag): whatever the
    process had set is there again afterwards, also when the call raises."""
    matmul = torch.backends.cuda.matmul
    seen, process = [], matmul.fp32_precision
    real = gdn_dqkwg._chunk_table  # the body's first step: what precision it runs under

    def table(*args):
        seen.append(matmul.fp32_precision)
        return real(*args)

    monkeypatch.setattr(gdn_dqkwg, "_chunk_table", table)
    x, h, g = torch.zeros(1, 64, 1, 8), torch.zeros(1, 1, 1, 8, 8), torch.zeros(1, 64, 1)
    matmul.fp32_precision = before
    try:
        gdn_dqkwg.chunk_bwd_dqkwg(x, x, x, x, h, h, w=x, g=g, dv=x)
        assert seen == ["tf32"] and matmul.fp32_precision == before

        def fails(*_):
            raise RuntimeError("inside")

        monkeypatch.setattr(gdn_dqkwg, "_chunk_table", fails)
        with pytest.raises(RuntimeError, match="inside"):
            gdn_dqkwg.chunk_bwd_dqkwg(x, x, x, x, h, h, w=x, g=g, dv=x)
        assert matmul.fp32_precision == before
    finally:
        matmul.fp32_precision = process


@pytest.mark.parametrize("legacy", [False, True])
def test_a_process_on_the_legacy_tf32_flag_reads_it_back_unchanged(legacy):
    """A training script that set ``torch.backends.cuda.matmul.allow_tf32`` (the legacy API) reads the same
    value after a call, without torch's error for mixing the two APIs (in a process of its own: the
    setting is process-wide)."""
    code = (
        "import torch\n"
        "from twinkle_specs import gdn_dqkwg\n"
        f"torch.backends.cuda.matmul.allow_tf32 = {legacy}\n"
        "x, h, g = torch.zeros(1, 64, 1, 8), torch.zeros(1, 1, 1, 8, 8), torch.zeros(1, 64, 1)\n"
        "gdn_dqkwg.chunk_bwd_dqkwg(x, x, x, x, h, h, w=x, g=g, dv=x)\n"
        "print(torch.backends.cuda.matmul.allow_tf32)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == str(legacy), run.stdout
