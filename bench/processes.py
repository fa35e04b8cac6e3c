"""Where each unit runs: in a fresh child process of ``bench/run.py --child`` (clean CUDA memory
statistics, megatron global state and CUDA-graph state; the default), or in this process
(``--in-process``); the multi-rank load under torchrun. Children are cut to the ``--budget``; their
output goes to run.log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_main(task_json: str, result_json: str) -> int:
    """The child's side: runs the unit described in ``task_json``, writes its result to ``result_json``."""
    from .load_timing import make_checkpoint
    from .task import Task, run_interleaved, run_task

    task = json.loads(Path(task_json).read_text())
    if task.get("kind") == "checkpoint":
        result = make_checkpoint(Path(task["hf_dir"]))
    elif task.get("kind") == "interleaved":
        result = {"results": run_interleaved(Task.from_dict(task["task"]), task["variants"])}
    else:
        result = run_task(Task.from_dict(task))
    Path(result_json).write_text(json.dumps(result, indent=1, default=str))
    return 0


def time_left(args, wanted: float) -> float | None:
    """Seconds a child may run: ``wanted``, cut to the --budget; None when the budget is used up."""
    if args.budget is None:
        return wanted
    left = args.budget - (time.monotonic() - args.started)
    return None if left < 30 else min(wanted, left - 10)


def tail_lines(text: str, n: int) -> str:
    lines = [ln for ln in text.splitlines() if "warnings.warn" not in ln and "UserWarning" not in ln]
    return "\n".join(lines[-n:]) + "\n"


def run_load_layout(name: str, hf_dir: Path, layout: str, args, log) -> dict:
    """bench/load.py under torchrun for one parallel layout (CPU ranks unless --load-on-gpu)."""
    from .load import world_size

    base = {"shape": name, "layout": layout, "on_gpu": args.load_on_gpu}
    timeout = time_left(args, args.variant_timeout)
    if timeout is None:
        return base | {"status": "skipped", "reason": f"--budget {args.budget:.0f} s used up"}
    out = args.out / "tasks" / f"{name}__load_{layout}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size(layout)}"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", str(ROOT / "bench" / "load.py")]
    cmd += ["--hf", str(hf_dir), "--layout", layout, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    if not args.load_on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log.write(f"\n===== {name} load {layout}: {' '.join(cmd)}\n")
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env
        )
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as err:
        output = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        rc = f"timeout after {timeout:.0f} s"
    log.write(tail_lines(output, 60))
    log.flush()
    if rc == 0 and out.exists():
        return base | {"status": "ok"} | json.loads(out.read_text())
    return base | {"status": "error", "error": f"torchrun exited {rc}", "log_tail": output[-3000:]}


def run_child(payload: dict, name: str, args, log) -> dict:
    """Runs one task in a fresh interpreter; its output goes to the log."""
    timeout = time_left(args, args.variant_timeout)
    if timeout is None:
        return {"status": "skipped", "reason": f"--budget {args.budget:.0f} s used up before this variant"}
    tmp = args.out / "tasks"
    tmp.mkdir(parents=True, exist_ok=True)
    task_file, result_file = tmp / f"{name}.task.json", tmp / f"{name}.result.json"
    task_file.write_text(json.dumps(payload, default=str))
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--child", str(task_file), str(result_file)]
    log.write(f"\n===== {name}: {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
        output = proc.stdout
        why = f"child process exited {proc.returncode} after {time.perf_counter() - t0:.0f} s"
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        # the harness's own limit, not a crash: say which, so a cut variant is not read as a failure
        limit = "--variant-timeout" if timeout >= args.variant_timeout else "what was left of --budget"
        why = f"stopped by the harness after {timeout:.0f} s ({limit})"
        output += f"\n[{why}]"
    log.write(tail_lines(output, 200))
    log.flush()
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {"status": "error", "error": f"{why} without a result", "log_tail": output[-3000:]}


def make_checkpoint(hf_dir: Path, name: str, args, log) -> dict:
    """The shape's random-weight HF checkpoint, written in a child (or here with --in-process)."""
    if args.in_process:
        from .load_timing import make_checkpoint as write

        return write(hf_dir)
    return run_child({"kind": "checkpoint", "hf_dir": str(hf_dir)}, f"{name}__checkpoint", args, log)


def run_unit(task, variants: list[str], name: str, args, log) -> list[dict]:
    """One result per variant: ``task`` alone, or ``variants`` interleaved in one process."""
    from .task import run_interleaved, run_task

    if not args.interleave:
        return [run_task(task) if args.in_process else run_child(task.as_dict(), name, args, log)]
    if args.in_process:
        return run_interleaved(task, variants)
    payload = {"kind": "interleaved", "task": task.as_dict(), "variants": variants}
    got = run_child(payload, name, args, log)
    return got["results"] if "results" in got else [dict(got) for _ in variants]
