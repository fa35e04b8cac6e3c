"""Prototype (an artifact of this results folder, not part of the harness): one adapted linear's forward
+ backward at the Qwen3-8B shape, CUDA-graphed, in three designs. frozen: the TE module, weight frozen
(the floor); current: the TE module + the adapter of tree 49bdbde (norm recompute through saved-tensor
hooks, the in-place B GEMM); fused: the frozen GEMM owned by the adapter, with a combined [W | B] weight
(B added in the GEMM epilogue, ``badd``, or concatenated on K, ``kconcat``). Ran on tree 49bdbde, where
``twinkle_specs.lora.layers._AddLowRank`` and ``twinkle_specs.lora.recompute.linear_recomputing_input``
existed (they are ``lora.functions.AddLowRank`` and ``lora.functions.LowRankDown`` since):

    PYTHONPATH=. python own_gemm_prototype.py     # output: own-gemm-prototype.log
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te

from twinkle_specs.lora.layers import _AddLowRank
from twinkle_specs.lora.recompute import linear_recomputing_input


class FusedColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xn, a, bf, wc, scaling, kconcat):
        n = xn.shape[-1]
        h = (xn @ a.t()) * scaling
        wc[:, n:].copy_(bf)
        if kconcat:
            y = torch.cat([xn, h], -1) @ wc.t()
        else:
            y = xn @ wc[:, :n].t()
            y.addmm_(h, bf.t())
        ctx.save_for_backward(xn, h, a, wc)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, g):
        xn, h, a, wc = ctx.saved_tensors
        n = xn.shape[-1]
        d = g @ wc
        dbf = g.t() @ h
        dh = d[:, n:] * ctx.scaling
        da = dh.t() @ xn
        dxn = torch.addmm(d[:, :n], dh, a)
        return dxn, da, dbf, None, None, None


def recomputing(inp, source, fn, call):
    storage = inp.untyped_storage().data_ptr()

    class R:
        __slots__ = ("shape", "stride", "off")

    def pack(t):
        if t.untyped_storage().data_ptr() == storage:
            r = R()
            r.shape, r.stride, r.off = t.shape, t.stride(), t.storage_offset()
            return r
        return t

    def unpack(p):
        if isinstance(p, R):
            with torch.no_grad():
                return fn(source).as_strided(p.shape, p.stride, p.off)
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return call()


def bench(step, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / iters


def run_linear(kind, n_in, n_out, rank, tokens, iters, norm):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(tokens, n_in, device=dev, dtype=dt, requires_grad=True)
    gy = torch.randn(tokens, n_out, device=dev, dtype=dt)
    if norm:
        mod = te.LayerNormLinear(
            n_in, n_out, eps=1e-6, bias=False, normalization="RMSNorm", params_dtype=dt, device=dev
        )
        gamma = mod.layer_norm_weight
    else:
        mod = te.Linear(n_in, n_out, bias=False, params_dtype=dt, device=dev)
        gamma = None
    for p in mod.parameters():
        p.requires_grad_(False)
    a = (torch.randn(rank, n_in, device=dev, dtype=dt) / n_in**0.5).requires_grad_(True)
    b = (torch.randn(n_out, rank, device=dev, dtype=dt) * 0.01).requires_grad_(True)
    scaling = 2.0
    wc = torch.empty(n_out, n_in + rank, device=dev, dtype=dt)
    wc[:, :n_in].copy_(mod.weight)
    normf = (lambda t: F.rms_norm(t, (n_in,), gamma, 1e-6)) if norm else (lambda t: t)
    out = {}

    def frozen():
        y = mod(x)
        return torch.autograd.grad(y, [x], gy)

    def current():
        y = mod(x)
        if norm:
            h = linear_recomputing_input(normf(x), a, x, normf) * scaling
        else:
            h = F.linear(x, a) * scaling
        y = _AddLowRank.apply(y, h, b)
        return torch.autograd.grad(y, [x, a, b], gy)

    def fused(kconcat):
        def step():
            xn = normf(x)
            if norm:
                y = recomputing(xn, x, normf, lambda: FusedColumn.apply(xn, a, b, wc, scaling, kconcat))
            else:
                y = FusedColumn.apply(xn, a, b, wc, scaling, kconcat)
            return torch.autograd.grad(y, [x, a, b], gy)

        return step

    def torch_frozen():
        xn = normf(x)
        y = xn @ wc[:, :n_in].t()
        return torch.autograd.grad(y, [x], gy)

    ref = current()
    for name, step in [
        ("frozen_te", frozen),
        ("frozen_torch", torch_frozen),
        ("current", current),
        ("fused_badd", fused(False)),
        ("fused_kconcat", fused(True)),
    ]:
        out[name] = bench(step, iters)
        if name.startswith("fused"):
            got = step()
            out[name + "_maxrel"] = [
                float((g.float() - r.float()).abs().max() / r.float().abs().max())
                for g, r in zip(got, ref, strict=True)
            ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    h, d = args.hidden, args.head_dim
    qkv = (args.heads + 2 * args.groups) * d
    linears = {
        "qkv": (h, qkv, 3 * args.rank, True),
        "proj": (args.heads * d, h, args.rank, False),
        "fc1": (h, 2 * args.ffn, 2 * args.rank, True),
        "fc2": (args.ffn, h, args.rank, False),
    }
    res = {}
    for kind, (i, o, r, norm) in linears.items():
        res[kind] = run_linear(kind, i, o, r, args.tokens, args.iters, norm)
        print(kind, json.dumps(res[kind]), flush=True)
    from megatron.core.fusions.fused_bias_swiglu import swiglu

    pre = torch.randn(args.tokens, 1, 2 * args.ffn, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        t2 = bench(lambda: swiglu(pre.view(-1, pre.shape[-1])), args.iters)
        t3 = bench(lambda: swiglu(pre), args.iters)
        t2b = bench(lambda: swiglu(pre.view(-1, pre.shape[-1])), args.iters)
    print("swiglu ms 2-D first:", round(t2, 4), "3-D after:", round(t3, 4), "2-D again:", round(t2b, 4))
    keys = ["frozen_te", "frozen_torch", "current", "fused_badd", "fused_kconcat"]
    print("per layer ms:", {k: round(sum(res[kind][k] for kind in res), 3) for k in keys})


if __name__ == "__main__":
    main()
