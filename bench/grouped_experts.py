"""One routed-expert LoRA linear on the GPU: the frozen grouped base and its adapters as one function
(the adapters' rank-r products summed into the base's output and input gradient in place) against the
chain it replaces (grouped base, grouped adapter delta, a full-size sum each way), and the in-place sum's
kernel alone per launch configuration.

Shapes are those of the MoE models' routed experts at 4,096 tokens (top-8, so 32,768 routed rows), r 16,
the routing drawn at random (about even, as a trained router's load-balancing keeps it). Times are CUDA
events around each forward + backward (median of ``--iters`` after ``--warmup``), on one GPU, nothing
else running on it; the inputs' and factors' gradients accumulate over the iterations (one in-place add per
leaf, the same on both sides), and each timing includes the gap before the host's first launch.

    python bench/grouped_experts.py [--iters 50] [--blocks 64,128,4 64,64,4 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's package
    sys.path.insert(0, str(ROOT))

from bench.timing import median_cuda_ms  # noqa: E402
from twinkle_specs.lora import experts, grouped_low_rank  # noqa: E402

# model: (hidden, expert ffn, experts); fc1 maps hidden -> 2 * ffn (gate | up), fc2 ffn -> hidden
MODELS = {"qwen3-30b-a3b": (2048, 768, 128), "qwen3.5-35b-a3b": (2048, 512, 256)}
TOKENS, TOPK, RANK, SCALING = 4096, 8, 16, 2.0


def _routing(n_experts: int, g: torch.Generator) -> torch.Tensor:
    """The blocks' ends for TOKENS tokens each routed to TOPK distinct experts at random."""
    picks = torch.rand(TOKENS, n_experts, generator=g).topk(TOPK, dim=1).indices
    counts = torch.bincount(picks.flatten(), minlength=n_experts)
    return counts.cumsum(0).to(torch.int32).cuda()


def _linear(n_in: int, n_out: int, ends: torch.Tensor, g: torch.Generator):
    """Routed tokens, frozen weight stack, factors and an output gradient for one expert linear."""
    rows, e = TOKENS * TOPK, ends.numel()

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", torch.bfloat16)

    x = rand(rows, n_in).requires_grad_(True)
    w = rand(e, n_out, n_in, scale=n_in**-0.5)
    a = rand(e, RANK, n_in, scale=n_in**-0.5).requires_grad_(True)
    b = rand(e, n_out, RANK, scale=0.1).requires_grad_(True)
    return x, w, a, b, rand(rows, n_out)


def _fused(x, w, a, b, ends):
    return experts.FrozenGroupedLora.apply(x, w, a, b, ends, SCALING, None, None)


def _chain(x, w, a, b, ends):
    return experts.FrozenGroupedMM.apply(x, w, ends) + experts.expert_delta_grouped(
        x, a, b, None, SCALING, ends
    )


def _site(n_in: int, n_out: int, ends: torch.Tensor, g, iters: int, warmup: int, blocks: list) -> dict:
    """Fused and chained forward + backward of one expert linear, and the in-place sum alone per
    launch configuration (the forward's: ``out += h @ B_eᵀ``, B read transposed)."""
    x, w, a, b, grad = _linear(n_in, n_out, ends, g)
    row: dict = {"in": n_in, "out": n_out, "experts": ends.numel()}
    for name, fn in (("fused_ms", _fused), ("chain_ms", _chain)):
        step = lambda: fn(x, w, a, b, ends).backward(grad)  # noqa: B023, E731
        row[name] = round(median_cuda_ms(step, iters, warmup), 4)
    row["saved_ms"] = round(row["chain_ms"] - row["fused_ms"], 4)
    h = torch.randn(x.shape[0], RANK, generator=g).to("cuda", torch.bfloat16)
    out = torch.randn(x.shape[0], n_out, generator=g).to("cuda", torch.bfloat16)
    moved = 2 * out.numel() * out.element_size()  # the output read and written once
    sweep = {}
    for config in blocks:
        grouped_low_rank.BLOCKS = config
        ms = median_cuda_ms(
            lambda: grouped_low_rank.grouped_low_rank_add_(out, h, b.transpose(1, 2), ends), iters, warmup
        )
        sweep[",".join(map(str, config))] = {"ms": round(ms, 4), "gb_per_s": round(moved / ms / 1e6, 1)}
    grouped_low_rank.BLOCKS = blocks[0]
    row["add_kernel"] = sweep
    return row


def run(iters: int, warmup: int, blocks: list[tuple[int, ...]]) -> dict:
    g = torch.Generator().manual_seed(0)
    grouped_low_rank.BLOCKS = blocks[0]
    results: dict = {"device": torch.cuda.get_device_name(), "tokens": TOKENS, "topk": TOPK, "rank": RANK}
    for model, (hidden, ffn, n_experts) in MODELS.items():
        ends = _routing(n_experts, g)
        for site, (n_in, n_out) in {"fc1": (hidden, 2 * ffn), "fc2": (ffn, hidden)}.items():
            results[f"{model}/{site}"] = _site(n_in, n_out, ends, g, iters, warmup, blocks)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--blocks",
        nargs="+",
        default=[",".join(map(str, grouped_low_rank.BLOCKS))],
        help="launch configurations of the in-place sum's kernel to time (grouped_low_rank.BLOCKS): "
        "rows,columns,warps",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    blocks = [tuple(int(v) for v in c.split(",")) for c in args.blocks]
    results = run(args.iters, args.warmup, blocks)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
