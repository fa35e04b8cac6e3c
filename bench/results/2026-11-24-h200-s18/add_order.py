"""Does the LoRA B delta cost less written first and summed in the base GEMM's epilogue (beta=1 on the
big, compute-bound GEMM) than added after it (beta=1 on the small, memory-bound GEMM)? Qwen3-8B sites,
T=4096, bf16, one GPU. Prints median µs per pair over 200 repetitions.

    python add_order.py [out.json]

(After the run, one site's body moved from the loop into ``site()`` for ruff's B023; same operations.)"""

import json
import sys

import torch

T = 4096
SITES = {"qkv": (6144, 4096, 48), "proj": (4096, 4096, 16), "fc2": (4096, 12288, 16)}


def timed(fn, reps=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
    return ts[len(ts) // 2]


def site(n, k, r):
    dev, dt = "cuda", torch.bfloat16
    x, w = torch.randn(T, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt) * 0.02
    h, b = torch.randn(T, r, device=dev, dtype=dt), torch.randn(n, r, device=dev, dtype=dt) * 0.02
    g, a = torch.randn(T, n, device=dev, dtype=dt), torch.randn(r, k, device=dev, dtype=dt) * 0.02
    dh = torch.randn(T, r, device=dev, dtype=dt)
    out = torch.empty(T, n, device=dev, dtype=dt)
    dx = torch.empty(T, k, device=dev, dtype=dt)
    row = {
        "base_fwd": timed(lambda: torch.mm(x, w.t(), out=out)),
        "base_fwd_beta1": timed(lambda: out.addmm_(x, w.t())),
        "delta_add_beta1": timed(lambda: out.addmm_(h, b.t())),
        "delta_write_beta0": timed(lambda: torch.mm(h, b.t(), out=out)),
        "base_dgrad": timed(lambda: torch.mm(g, w, out=dx)),
        "base_dgrad_beta1": timed(lambda: dx.addmm_(g, w)),
        "lowrank_dgrad_add_beta1": timed(lambda: dx.addmm_(dh, a)),
        "lowrank_dgrad_write_beta0": timed(lambda: torch.mm(dh, a, out=dx)),
    }
    row["fwd_now"] = timed(lambda: (torch.mm(x, w.t(), out=out), out.addmm_(h, b.t())))
    row["fwd_reversed"] = timed(lambda: (torch.mm(h, b.t(), out=out), out.addmm_(x, w.t())))
    row["bwd_now"] = timed(lambda: (torch.mm(g, w, out=dx), dx.addmm_(dh, a)))
    row["bwd_reversed"] = timed(lambda: (torch.mm(dh, a, out=dx), dx.addmm_(g, w)))
    return {k2: round(v, 1) for k2, v in row.items()}


def main():
    torch.manual_seed(0)
    res = {}
    for name, (n, k, r) in SITES.items():
        res[name] = site(n, k, r)
        print(name, res[name], flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "us": res}))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
