"""fc1's LoRA delta fused into SwiGLU (twinkle_specs.lora.swiglu) against the unfused path, on one GPU.

Prints JSON lines: the Triton path's error against the op's torch reference path (bf16, output and the
gradients of pre, h and b), then CUDA-graph-replayed times (ms per call) of
- unfused_fwd: in-place ``pre.addmm_(h, b.T)`` + megatron-core's ``swiglu`` (unfused_addmm: the GEMM alone)
- fused_fwd: ``swiglu_lora_forward``
- swiglu_back: megatron-core's ``swiglu_back(g, y)`` alone
- fused_bwd: the op's backward (kernel + ``dy @ b`` + ``dy.T @ h``)
- unfused_bwd: ``swiglu_back`` + ``dy @ b`` + ``dy.T @ h``

    PYTHONPATH=. python bench/swiglu_lora.py [--tokens 4096 --ffn 12288 --rank 32 --iters 50]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from types import SimpleNamespace

import torch
from megatron.core.fusions.fused_bias_swiglu import swiglu, swiglu_back

from twinkle_specs.lora import swiglu as S


def graph_ms(fn: Callable[[], object], iters: int) -> float:
    """ms per replay of a CUDA graph of ``fn()``, after eager warm-up on a side stream (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def fused_backward(dout: torch.Tensor, pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor):
    """The op's own backward, called without autograd (a frozen-base fc1 still needs d_pre)."""
    ctx = SimpleNamespace(saved_tensors=(pre, h, b), needs_input_grad=(True, True, True))
    return S.SwigluLora.backward(ctx, dout)


def unfused_backward(dout: torch.Tensor, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor):
    """What the unfused path runs for the same gradients: d_pre is swiglu_back's output itself."""
    d = swiglu_back(dout, y)
    return d, d @ b, d.t() @ h


def errors(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor, dout: torch.Tensor) -> None:
    """Triton path vs the op's torch reference path on the same bf16 inputs."""
    results = {}
    for name, triton in (("triton", True), ("reference", False)):
        use = S._use_triton
        S._use_triton = lambda *_, forced=triton: forced
        try:
            results[name] = [S.swiglu_lora_forward(pre, h, b), *fused_backward(dout, pre, h, b)]
        finally:
            S._use_triton = use
    for name, t, r in zip(
        ("out", "d_pre", "d_h", "d_b"), results["triton"], results["reference"], strict=True
    ):
        diff = (t.float() - r.float()).abs()
        rel = diff.max() / r.float().abs().max()
        frac = (t != r).float().mean()
        print(json.dumps({"error": name, "max_abs": diff.max().item(), "max_rel": rel.item(),
                          "differing": frac.item()}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--block", default=None, help="BLOCK_T,BLOCK_F,NUM_WARPS overriding the module's")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference path's fp32 GEMM must be exact fp32
    if args.block:
        S.BLOCK_T, S.BLOCK_F, S.NUM_WARPS = (int(v) for v in args.block.split(","))
    T, F, R, dt = args.tokens, args.ffn, args.rank, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    pre = torch.randn(T, 2 * F, device="cuda", generator=g).to(dt)
    h = torch.randn(T, R, device="cuda", generator=g).to(dt)
    b = (torch.randn(2 * F, R, device="cuda", generator=g) / R**0.5).to(dt)
    dout = torch.randn(T, F, device="cuda", generator=g).to(dt)
    print(json.dumps({"device": torch.cuda.get_device_name(), "tokens": T, "ffn": F, "rank": R,
                      "block": [S.BLOCK_T, S.BLOCK_F, S.NUM_WARPS]}))  # fmt: skip
    errors(pre, h, b, dout)

    acc = pre.clone()  # the unfused forward adds into its input: keep pre for the fused runs
    y = torch.addmm(pre, h, b.t())
    times = {
        "unfused_addmm": lambda: acc.addmm_(h, b.t()),
        "unfused_fwd": lambda: swiglu(acc.addmm_(h, b.t())),
        "fused_fwd": lambda: S.swiglu_lora_forward(pre, h, b),
        "swiglu_back": lambda: swiglu_back(dout, y),
        "fused_bwd": lambda: fused_backward(dout, pre, h, b),
        "unfused_bwd": lambda: unfused_backward(dout, y, h, b),
    }
    for name, fn in times.items():
        print(json.dumps({"time": name, "ms": round(graph_ms(fn, args.iters), 4)}))


if __name__ == "__main__":
    main()
