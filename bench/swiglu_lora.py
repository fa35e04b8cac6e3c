"""An adapted MLP's SwiGLU with fc1's and fc2's adapters folded in (twinkle_specs.lora.swiglu) against
the unfused path it replaces, on one GPU: CUDA-graph-replayed ms per call, for each launch configuration
given, as JSON lines.

- unfused_fwd: fc1's delta added in place (``pre.addmm_(h, b.T)``) + megatron-core's compiled ``swiglu``
- fused_fwd: ``swiglu_lora_forward``
- unfused_bwd: what the adapters' backward ran around SwiGLU before: fc2's input-gradient share
  accumulated into fc2's dgrad (``dout.addmm_(dh2, a2)``), fc2's input recomputed (``swiglu``), a2's
  gradient (``dh2.T @ act``), ``swiglu_back``, fc1's B gradients (``dy @ b``, ``dy.T @ h``)
- fused_bwd: the op's backward kernel + ``dy @ b`` (everything above)
- ``--halves``: the fused_* rows with fc1's own B (gate and up at one rank, rank/2 each) instead of
  the fused B with its zero blocks

    PYTHONPATH=. python bench/swiglu_lora.py [--tokens 4096 --ffn 12288 --rank 32 --rank2 16 --iters 50]
        [--fwd 64,128,8 --fwd ...] [--bwd 32,64,4,3,2 --bwd ...]

Errors of the kernels against the reference path are tests/test_lora_swiglu.py's (gpu-marked).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

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


def _blocks(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--rank", type=int, default=32, help="fc1's rank sum (gate + up)")
    ap.add_argument("--rank2", type=int, default=16, help="fc2's rank")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--halves",
        action="store_true",
        help="fused_*: fc1's own B [2F, rank/2], h's gate and up columns apart",
    )
    ap.add_argument("--fwd", type=_blocks, action="append", help="token block, F block, warps (repeatable)")
    ap.add_argument(
        "--bwd", type=_blocks, action="append", help="token block, F block, warps, stages, waves (repeatable)"
    )
    args = ap.parse_args()
    T, F, R, R2, dt = args.tokens, args.ffn, args.rank, args.rank2, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dt)

    pre, h, b = randn(T, 2 * F), randn(T, R), randn(2 * F, R, scale=R**-0.5)
    bf = randn(2 * F, R // 2, scale=(R // 2) ** -0.5) if args.halves else b  # the fused path's B
    dout, dh2, a2 = randn(T, F), randn(T, R2), randn(R2, F, scale=F**-0.5)
    print(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "tokens": T, "ffn": F, "rank": R, "rank2": R2}
            | {"halves": args.halves}
        )
    )

    acc, dacc = pre.clone(), dout.clone()  # the unfused in-place sums' targets
    y = torch.addmm(pre, h, b.t())

    def unfused_bwd():
        d = dacc.addmm_(dh2, a2)
        act = swiglu(y)
        da2 = dh2.t() @ act
        dy = swiglu_back(d, y)
        return dy @ b, dy.t() @ h, da2

    def fused_bwd():
        dy, d_b, d_a2 = S._triton_backward(dout, pre, h, bf, dh2, a2)
        return S._h_grad(dy, bf, h), d_b, d_a2

    base = {
        "unfused_fwd": lambda: swiglu(acc.addmm_(h, b.t())),
        "unfused_bwd": unfused_bwd,
    }
    for name, fn in base.items():
        print(json.dumps({"time": name, "ms": round(graph_ms(fn, args.iters), 4)}))
    for blocks in args.fwd or [S.FWD_BLOCKS]:
        S.FWD_BLOCKS = blocks
        ms = graph_ms(lambda: S.swiglu_lora_forward(pre, h, bf), args.iters)
        print(json.dumps({"time": "fused_fwd", "blocks": blocks, "ms": round(ms, 4)}))
    for blocks in args.bwd or [S.BWD_BLOCKS]:
        S.BWD_BLOCKS = blocks
        print(
            json.dumps(
                {"time": "fused_bwd", "blocks": blocks, "ms": round(graph_ms(fused_bwd, args.iters), 4)}
            )
        )


if __name__ == "__main__":
    main()
