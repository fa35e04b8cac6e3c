"""Runs one rank of a megatron layout (via torchrun, gloo, CPU): build + load, forward, export.

Writes, on the last pipeline stage's TP rank 0, the full logits to OUT/logits.pt, each rank's load
report to OUT/load-RANK.json, and the exported HF checkpoint to OUT/export. With ``--jobs FILE`` it
runs several layouts in turn in one process group (tests/dist_jobs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dist_jobs import run_jobs  # noqa: E402
from models import batch  # noqa: E402


def main() -> None:
    from megatron.core import parallel_state as ps  # noqa: F401  (imported before the jobs start)

    import twinkle_specs as ts  # noqa: F401

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    run_jobs(_layout, sys.argv[1:])
    dist.destroy_process_group()


def _layout(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallel (with --tp > 1)")
    ap.add_argument("--tokens", help="a torch.save'd [b, s] token tensor (default: models.batch())")
    ap.add_argument("--moe-router-dtype", help="megatron's moe_router_dtype (e.g. fp64)")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    with _no_cuda_rng_fork() if args.sp and not on_gpu else contextlib.nullcontext():
        _run_layout(args, on_gpu)


@contextlib.contextmanager
def _no_cuda_rng_fork():
    """Megatron's embedding forks the CUDA RNG tracker around its dropout under sequence parallelism, which
    needs CUDA; in eval nothing draws from it, so on the CPU the fork is a no-op for this job."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork  # the class's own again


def _run_layout(args: argparse.Namespace, on_gpu: bool) -> None:
    from megatron.core import parallel_state as ps

    import twinkle_specs as ts

    ps.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep)
    router = {"moe_router_dtype": args.moe_router_dtype} if args.moe_router_dtype else {}
    model = ts.build_model(args.hf, load_weights=False, sequence_parallel=args.sp, **router).eval()
    report = ts.load_hf_weights(model, args.hf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    (out / f"load-{rank}.json").write_text(
        json.dumps({"bytes_read": report.bytes_read, "checkpoint_bytes": report.checkpoint_bytes})
    )
    tokens = (torch.load(args.tokens) if args.tokens else batch()).to("cuda" if on_gpu else "cpu")
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(
                tokens.shape[1], tokens.shape[0], model.config.hidden_size, device=tokens.device
            )
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        result = model(tokens, pos, None)
        if not ps.is_pipeline_last_stage():
            dist.send(result.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            parts = [torch.empty_like(result) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, result.contiguous(), group=ps.get_tensor_model_parallel_group())
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                torch.save(torch.cat(parts, dim=-1).cpu(), out / "logits.pt")
    ts.save_hf_weights(model, out / "export")
    _dist_checkpoint_round_trip(model, args.hf, out)
    dist.barrier()
    ps.destroy_model_parallel()


def _dist_checkpoint_round_trip(model, hf: str, out: Path) -> None:
    """Megatron's own checkpoint format (what --save writes): save this layout's sharded_state_dict, load
    it into a fresh, unloaded model and require every parameter back bit-exactly."""
    from megatron.core import dist_checkpointing

    import twinkle_specs as ts

    ckpt = out / "dist"
    if dist.get_rank() == 0:
        ckpt.mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt))
    fresh = ts.build_model(hf, load_weights=False)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(ckpt)), strict=True)
    loaded = dict(fresh.named_parameters())
    mismatched = [n for n, p in model.named_parameters() if not torch.equal(p, loaded[n])]
    (out / f"dist-ckpt-{dist.get_rank()}.json").write_text(json.dumps({"mismatched": mismatched}))


if __name__ == "__main__":
    main()
