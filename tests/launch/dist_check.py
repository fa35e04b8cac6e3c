"""A stand-in for the training entry, run once per rank by the Slurm and Ray launch tests.

Why it exists: the launch scripts must start *any* command with a correct torch.distributed
environment, so the tests run this small program instead of a real training job. It does what the
real entry does at start-up (env -> ``init_process_group`` -> megatron-core model-parallel init), checks
collectives, and mimics Megatron's checkpoint bookkeeping (``--save``/``--load`` directories with
``latest_checkpointed_iteration.txt``, ``--exit-signal-handler``) so resume can be observed.

Per rank it writes ``<out>/rank_<R>.json`` (the env it saw and its results) and, while it runs,
``<out>/pid_rank_<R>`` so a test can kill one rank from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "NODE_RANK",
    "GROUP_RANK",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_RESTART_COUNT",
    "TWINKLE_RESTART_COUNT",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Megatron-like flags; unknown ones are ignored, as a real entry would forward them."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="directory for the per-rank JSON results")
    p.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    p.add_argument("--save", default=None, help="checkpoint dir written by rank 0 (Megatron --save)")
    p.add_argument("--load", default=None, help="checkpoint dir read at start (Megatron --load)")
    p.add_argument("--train-iters", type=int, default=1)
    p.add_argument("--iter-seconds", type=float, default=0.0, help="sleep per iteration")
    p.add_argument("--exit-signal-handler", action="store_true", help="SIGTERM: save and exit 0")
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank kills itself once ...")
    p.add_argument("--fail-at-iter", type=int, default=-1, help="... at this iteration (first run only)")
    p.add_argument("--raise-rank", type=int, default=-1, help="this rank exits with code 3 at start")
    p.add_argument("--print-kib", type=int, default=0, help="print this many KiB at start (chatty ranks)")
    args, _unknown = p.parse_known_args(argv)
    return args


def read_tracker(ckpt: str | None) -> int:
    """Megatron resumes from the iteration in latest_checkpointed_iteration.txt; 0 when absent."""
    if not ckpt:
        return 0
    path = Path(ckpt) / TRACKER
    return int(path.read_text().strip()) if path.is_file() else 0


def save_checkpoint(ckpt: str, iteration: int) -> None:
    """Write iter_XXXXXXX/ then the tracker, in Megatron's order (tracker last, atomically)."""
    root = Path(ckpt)
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.json").write_text(json.dumps({"iteration": iteration}))
    tmp = root / f".{TRACKER}.tmp"
    tmp.write_text(str(iteration))
    os.replace(tmp, root / TRACKER)


def main(argv: list[str]) -> int:
    """Init distributed + megatron parallel state, check all-reduces, iterate with checkpoints."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    (out / f"pid_rank_{rank}").write_text(str(os.getpid()))
    for _ in range(args.print_kib):
        print("dist_check: " + "x" * 1010, flush=False)
    sys.stdout.flush()
    if rank == args.raise_rank:
        print(f"dist_check: rank {rank} raising on purpose (--raise-rank)", file=sys.stderr, flush=True)
        return 3

    stop = {"flag": False}
    if args.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    dp_group = ps.get_data_parallel_group()
    d = torch.ones(1)
    dist.all_reduce(d, group=dp_group)
    tp_group = ps.get_tensor_model_parallel_group()
    tpt = torch.ones(1)
    dist.all_reduce(tpt, group=tp_group)

    start = read_tracker(args.load)
    it = start
    stopped_by_signal = False
    while it < args.train_iters:
        if args.iter_seconds:
            time.sleep(args.iter_seconds)
        it += 1
        if rank == args.fail_rank and it == args.fail_at_iter and args.save:
            marker = Path(args.save) / f".failed_once_rank{rank}"
            if not marker.exists():
                marker.write_text("1")
                print(f"dist_check: rank {rank} killing itself at iteration {it}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        step = torch.ones(1)
        dist.all_reduce(step)  # every rank must be alive for an iteration to complete
        if rank == 0 and args.save:
            save_checkpoint(args.save, it)
        print(f"dist_check: rank {rank} iteration {it}/{args.train_iters}", flush=True)
        flag = torch.tensor([1.0 if stop["flag"] else 0.0])
        dist.all_reduce(flag)  # like Megatron: all ranks agree to stop at the same iteration
        if flag.item() > 0:
            stopped_by_signal = True
            print(f"dist_check: rank {rank} got SIGTERM, saved iteration {it}, exiting", flush=True)
            break
        dist.barrier()

    result = {
        "env": env,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "allreduce": t.item(),
        "expected": expected,
        "dp_size": ps.get_data_parallel_world_size(),
        "dp_allreduce": d.item(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "tp_allreduce": tpt.item(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "start_iteration": start,
        "end_iteration": it,
        "stopped_by_signal": stopped_by_signal,
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(result, indent=1))
    ok = t.item() == expected and d.item() == result["dp_size"] and tpt.item() == args.tp
    dist.barrier()  # every rank leaves together (a gloo group torn down mid-talk aborts its peer)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    print(f"dist_check: rank {rank}/{world} allreduce={t.item()} expected={expected} ok={ok}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
