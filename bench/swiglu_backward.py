"""The LoRA SwiGLU backward kernel alone at a dense shape's MLP: how far it runs from the device's copy rate,
and what its grid's token chunks change. The probe for work on that kernel.

``twinkle_specs.lora.swiglu``'s backward reads fc1's output and the incoming gradient and writes SwiGLU's
gradient (about 503 MB per layer at Qwen3-8B's shape and seq 4096), accumulating the adapters' factor
gradients in registers. Its grid is (F blocks, token chunks): each program walks its chunk's tokens and writes
one partial sum per chunk. This times the kernel per chunk count (0: the committed choice, as many chunks as
fill ``BWD_BLOCKS``' resident programs per SM once), the counts interleaved over ``--reps`` rounds after a
warm-up that brings the clocks up (single timings wander by 20 % on an H200), next to a device copy of the same
bytes. ``--baseline FILE`` adds another version of the kernel's module (``git show
REV:twinkle_specs/lora/swiglu.py > FILE``) at its own committed choice to the same rounds.

The kernel's module is loaded from its file, so this runs on a GPU machine that has only torch (and its
Triton) and transformers, without megatron-core or the package installed.

    python bench/swiglu_backward.py --shapes qwen3-8b,qwen3-1.7b --chunks 0,2,3,4,5 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is importable as a package from the root
    sys.path.insert(0, str(ROOT))


def swiglu_module(path: Path = ROOT / "twinkle_specs" / "lora" / "swiglu.py", name: str = "swiglu"):
    """``twinkle_specs/lora/swiglu.py`` (or another version of it) on its own (the package's ``__init__``
    imports megatron-core)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp_inputs(shape: str, seq: int, rank: int, device: str, dtype: torch.dtype) -> tuple:
    """The backward's arguments as the model passes them: fc1's output [T, 2F], the gradient [T, F], fc1's
    adapter input with gate's and up's halves [T, 2r] and its B [2F, r], fc2's deferred adapter gradient
    [T, r] and A [r, F], fc2's scaling."""
    from bench import shapes

    f = shapes.hf_config(shape).intermediate_size
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * std).to(device, dtype)

    return (
        rand(seq, f, std=0.1),
        rand(seq, 2 * f),
        rand(seq, 2 * rank),
        rand(2 * f, rank, std=0.05),
        rand(seq, rank, std=0.1),
        rand(rank, f, std=0.05),
        2.0,
    )


def traffic_bytes(args: tuple) -> int:
    """What the kernel must move: fc1's output read and its gradient written (both [T, 2F]), the incoming
    gradient read; the rank-r tiles are noise."""
    dout, pre = args[0], args[1]
    return (2 * pre.numel() + dout.numel()) * pre.element_size()


def copy_of(block: torch.Tensor) -> torch.Tensor:
    """A device copy: reads ``block`` and writes as many bytes, the rate the kernel's traffic is held to."""
    return torch.empty_like(block).copy_(block)


def measure(args: argparse.Namespace) -> dict:
    from bench.timing import median_cuda_ms

    swiglu = swiglu_module()
    baseline = swiglu_module(args.baseline, "swiglu_baseline") if args.baseline else None
    results = {"device": torch.cuda.get_device_name(), "seq": args.seq, "rank": args.rank, "shapes": {}}
    if baseline is not None:
        results["baseline"] = str(args.baseline)
    for shape in args.shapes:
        inputs = mlp_inputs(shape, args.seq, args.rank, "cuda", torch.bfloat16)
        reference = swiglu._triton_backward(*inputs)[:3]
        runs = {
            str(c): (lambda c=c, inputs=inputs: swiglu._triton_backward(*inputs, chunks=c or None))
            for c in args.chunks
        }
        if baseline is not None:
            runs["baseline"] = lambda inputs=inputs: baseline._triton_backward(*inputs)
        for c, run in runs.items():  # the same gradients at every grid
            for got, want in zip(run()[:3], reference, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=f"{shape}, {c} chunks")
        warm_until = time.monotonic() + args.warmup_s
        while time.monotonic() < warm_until:
            runs[str(args.chunks[0])]()
        torch.cuda.synchronize()
        rounds: dict[str, list[float]] = {c: [] for c in runs}
        for _ in range(args.reps):
            for c, run in runs.items():
                rounds[c].append(median_cuda_ms(run, args.iters, warmup=2) * 1e3)
        moved = traffic_bytes(inputs)
        block = torch.empty(moved // 4, device="cuda", dtype=torch.bfloat16)  # half read, half written
        copy_us = median_cuda_ms(functools.partial(copy_of, block), args.iters, warmup=2) * 1e3
        kernel = {c: statistics.median(ts) for c, ts in rounds.items()}
        results["shapes"][shape] = {
            "traffic_mb": moved / 1e6,
            "copy_us": copy_us,
            "copy_tb_per_s": moved / copy_us / 1e6,
            "kernel_us_by_chunks": kernel,
            "kernel_tb_per_s_by_chunks": {c: moved / us / 1e6 for c, us in kernel.items()},
            "rounds_us": rounds,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=["qwen3-8b", "qwen3-1.7b"])
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[0, 2, 3, 4, 5])
    parser.add_argument("--seq", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--baseline", type=Path, help="another swiglu.py to time at its committed choice")
    parser.add_argument("--reps", type=int, default=6, help="interleaved rounds over the chunk counts")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per round and count")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/swiglu_backward.py times a CUDA kernel: run it on a GPU machine")
    results = measure(args)
    for shape, r in results["shapes"].items():
        print(
            f"{shape}: {r['traffic_mb']:.0f} MB; copy {r['copy_us']:.1f} us ({r['copy_tb_per_s']:.2f} TB/s)"
        )
        for c, us in r["kernel_us_by_chunks"].items():
            tbs = r["kernel_tb_per_s_by_chunks"][c]
            name = {"0": "committed", "baseline": "baseline (committed)"}.get(c, c)
            print(f"  chunks {name}: {us:.1f} us ({tbs:.2f} TB/s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
