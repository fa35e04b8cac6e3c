"""twinkle-specs benchmark: one command, all variants, same GPU (see bench/README.md).

    python bench/run.py --preset quick --out /tmp/bench --export "$OUT"

Each (shape, variant) runs in its own child process (clean CUDA memory statistics, megatron global
state and CUDA-graph state); ``--in-process`` runs them in this process instead (the CPU test), and
``--interleave`` runs all Megatron variants of a shape in one child process, step by step in turn.
Results merge into ``<out>/results.json`` (same shape/variant/seq/mbs/tag replaced), and
``results.md`` and ``results.png`` are rewritten from it, so a long benchmark can be split over
several calls that share ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.shapes import SHAPES, shape_name, write_config  # noqa: E402

ALL_VARIANTS = ("mcore_te_full", "twinkle_full", "twinkle_lora", "hf_peft_lora", "twinkle_frozen", "hf_full")
DEFAULT_VARIANTS = ("mcore_te_full", "twinkle_full", "twinkle_lora", "hf_peft_lora", "twinkle_frozen")
PRESETS = {
    # all five variants on the 1.7B shape: ~3-5 minutes on an H100 (fits one 600 s device call)
    "quick": {
        "shapes": ["qwen3-1.7b"],
        "warmup": 3,
        "steps": 10,
        "seq": 4096,
        "load_layouts": ["tp2", "pp2"],
    },
    # every shape; run it over several calls (--shapes a subset per call, same --out)
    "full": {
        "shapes": ["qwen3-1.7b", "qwen2.5-1.5b", "qwen3-8b", "qwen3-30b-a3b"],
        "warmup": 3,
        "steps": 20,
        "seq": 4096,
    },
    # CPU test
    "tiny": {"shapes": ["tiny-qwen3"], "warmup": 1, "steps": 2, "seq": 64},
}
EXPORT_FILES = ("results.json", "results.md", "results.png", "run.log", "profile.txt")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _literal(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--shapes", type=_csv, help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=_csv, default=[], help="SHAPE=N overrides of the layer count")
    ap.add_argument(
        "--variants", type=_csv, default=list(DEFAULT_VARIANTS), help=f"from {', '.join(ALL_VARIANTS)}"
    )
    ap.add_argument("--seq", type=int, help="sequence length (preset: 4096)")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size (sequences per step)")
    ap.add_argument("--warmup", type=int, help="untimed iterations before timing")
    ap.add_argument("--steps", type=int, help="timed iterations")
    ap.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--no-ce-fusion", action="store_true", help="megatron: unfused vocab-parallel CE")
    ap.add_argument("--ce-impl", choices=["te", "native"], default="te", help="fused CE implementation")
    ap.add_argument(
        "--cuda-graphs",
        choices=["none", "local", "transformer_engine", "full_iteration"],
        default="none",
        help="megatron-core cuda_graph_impl: per-layer CUDA graphs (megatron's local manager or TE's); "
        "full_iteration: megatron's whole-iteration graph (FullCudaGraphWrapper, as Megatron-LM's "
        "--cuda-graph-impl local --cuda-graph-scope full_iteration; dense shapes; stock pretrain_gpt.py "
        "of core_v0.16.1 cannot capture it, see bench/README.md)",
    )
    ap.add_argument("--no-gpu-fusions", action="store_true", help="megatron: no rope/swiglu fusions")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="extra megatron TransformerConfig field (JSON value), e.g. --set moe_permute_fusion=true",
    )
    ap.add_argument(
        "--opt-set",
        dest="opt_overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="extra megatron OptimizerConfig field (JSON value), e.g. --opt-set use_precision_aware_optimizer=true",
    )
    ap.add_argument("--no-load", action="store_true", help="skip writing/loading the HF checkpoint")
    ap.add_argument(
        "--load-layouts",
        type=_csv,
        default=None,
        help="also time the HF load on several ranks (torchrun), e.g. tp2,pp2,ep2 (preset quick: tp2,pp2)",
    )
    ap.add_argument("--load-on-gpu", action="store_true", help="--load-layouts ranks on GPUs (NCCL), not CPU")
    ap.add_argument("--profile", action="store_true", help="torch profiler after timing: profile.txt")
    ap.add_argument("--profile-trace", action="store_true", help="with --profile: chrome traces too")
    ap.add_argument(
        "--no-telemetry", action="store_true", help="do not sample the GPU's clocks/power with nvidia-smi"
    )
    ap.add_argument("--tag", default="", help="label of this configuration (kept apart in ratios)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the variant list this many times, interleaved (a b c.. a b c..): pooled step times, "
        "per-run medians in repeat_medians (run-to-run noise, e.g. for the 2%% (b)/(a) target)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="build the (Megatron, eager) variants side by side in one process and time them step by "
        "step in turn (a b, b a, ..): host drift between processes falls on all alike; needs memory "
        "for every model at once; no load timing, profiler or activation memory",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "latest")
    ap.add_argument("--work", type=Path, default=Path("/tmp/twinkle-bench"), help="configs and checkpoints")
    ap.add_argument("--export", type=Path, help="copy results.{json,md,png}, run.log, profile.txt here")
    ap.add_argument("--fresh", action="store_true", help="do not merge with an existing results.json")
    ap.add_argument("--in-process", action="store_true", help="run variants in this process")
    ap.add_argument(
        "--no-pin", action="store_true", help="do not restrict the run to the GPU's NUMA-node CPUs"
    )
    ap.add_argument("--variant-timeout", type=int, default=300, help="seconds per child process")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wall-time budget of this call: children are cut to fit, later ones skipped (results kept)",
    )
    ap.add_argument("--report-only", action="store_true", help="re-render results.md/png from results.json")
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        metavar="RESULTS_JSON",
        help="with --report-only: merge these results.json files (later ones win) into --out first",
    )
    ap.add_argument("--child", nargs=2, metavar=("TASK_JSON", "RESULT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    args.shapes = args.shapes or preset["shapes"]
    args.seq = args.seq or preset["seq"]
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    args.steps = args.steps or preset["steps"]
    if args.load_layouts is None:
        args.load_layouts = preset.get("load_layouts", [])
    for v in args.variants:
        if v not in ALL_VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(ALL_VARIANTS)}")
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    if args.interleave:
        hf = [v for v in args.variants if v.startswith("hf_")]
        if hf or len(args.variants) < 2:
            ap.error(f"--interleave takes two or more Megatron variants (not {', '.join(hf) or 'one'})")
        if args.cuda_graphs != "none" or args.profile:
            ap.error("--interleave runs eager and unprofiled: drop --cuda-graphs / --profile")
        args.no_load, args.load_layouts = True, []  # load timing is its own measurement
    return args


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    names = ("torch", "megatron-core", "transformers", "peft", "safetensors", "twinkle-specs")
    # TE ships as a meta package plus core and torch-extension wheels; record whichever are installed
    names += (
        "transformer-engine",
        "transformer-engine-cu13",
        "transformer-engine-cu12",
        "transformer-engine-torch",
    )
    for dist in names:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _git_head() -> str | None:
    """HEAD of this checkout, marked "(modified)" when the measured code differs from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "twinkle_specs", "bench", "patches"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + (" (modified)" if dirty else "")


def git_commit(out: Path) -> str | None:
    """This tree's commit: $TWINKLE_BENCH_COMMIT when set (the device machine's copy of the tree may
    carry a stale .git), else git, else the COMMIT file bench/stage.sh writes into .gpu/bench-whl
    (carried in the first benchmark call), then <out>/COMMIT (saved by an earlier call, same --out)."""
    commit = os.environ.get("TWINKLE_BENCH_COMMIT") or _git_head()
    for f in (ROOT / ".gpu" / "bench-whl" / "COMMIT", out / "COMMIT"):
        if not commit and f.is_file():
            commit = f.read_text().strip()
    if commit:
        out.mkdir(parents=True, exist_ok=True)
        (out / "COMMIT").write_text(commit + "\n")
    return commit


def environment(in_process: bool, out: Path) -> dict:
    import torch

    env: dict = {"hostname": platform.node(), "versions": _versions(), "cuda": torch.version.cuda}
    env["env_vars"] = {
        k: os.environ.get(k)
        for k in (
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "NCCL_NVLS_ENABLE",
            "PYTORCH_CUDA_ALLOC_CONF",
            "OMP_NUM_THREADS",
            "TWINKLE_PATCHES_OFF",
        )
        if os.environ.get(k) is not None
    }
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        gpus = [g.strip() for g in proc.stdout.splitlines() if g.strip()]
    if not gpus and torch.cuda.is_available():
        if in_process:
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        else:  # ask a child, so that this process holds no CUDA context while the variants run
            code = "import torch; [print(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]"
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            gpus = [g.strip() for g in proc.stdout.splitlines() if g.strip()] or ["unknown GPU"]
    env["device"] = gpus[0] if gpus else "cpu"
    env["gpu_count"] = len(gpus)
    if hasattr(os, "sched_getaffinity"):
        env["cpu_affinity"] = _cpu_list(os.sched_getaffinity(0))
    env["git_commit"] = git_commit(out)
    return env


def _cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _parse_cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def pin_to_gpu_numa_node() -> str:
    """Restricts this process (and the variants' child processes, which inherit it) to the CPUs of the
    first GPU's NUMA node that it may run on, as NVIDIA's launch scripts do with numactl. A host-bound
    step (the MoE shape launches thousands of kernels) otherwise moves between sockets from run to run,
    and its launches cross the inter-socket link to reach the GPU. Returns what was done."""
    if not hasattr(os, "sched_setaffinity") or not shutil.which("nvidia-smi"):
        return "not pinned: no sched_setaffinity or nvidia-smi"
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
    )
    bus = proc.stdout.strip().lower()
    if proc.returncode or not bus:
        return "not pinned: nvidia-smi gave no PCI bus id"
    domain, _, rest = bus.partition(":")
    local = Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/local_cpulist")
    if not local.exists():
        return f"not pinned: no {local}"
    allowed = os.sched_getaffinity(0)
    cpus = _parse_cpu_list(local.read_text()) & allowed
    if not cpus or cpus == allowed:
        return f"not pinned: GPU-local CPUs {local.read_text().strip()}, allowed {_cpu_list(allowed)}"
    os.sched_setaffinity(0, cpus)
    return f"pinned to {_cpu_list(cpus)} (GPU 0 at {bus}; allowed were {_cpu_list(allowed)})"


def _layers(args) -> dict[str, int]:
    out = {}
    for item in args.layers:
        shape, _, n = item.partition("=")
        out[shape] = int(n)
    return out


def _settings(args, on_gpu: bool):
    from bench.harness import Settings

    return Settings(
        seq_len=args.seq,
        micro_batch_size=args.mbs,
        warmup=args.warmup,
        steps=args.steps,
        dtype=args.dtype or ("bf16" if on_gpu else "fp32"),
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        ce_fusion=not args.no_ce_fusion,
        ce_fusion_impl=args.ce_impl,
        cuda_graphs=args.cuda_graphs,
        gpu_fusions=not args.no_gpu_fusions,
        mcore_overrides={k: _literal(v) for k, _, v in (o.partition("=") for o in args.overrides)},
        optimizer_overrides={k: _literal(v) for k, _, v in (o.partition("=") for o in args.opt_overrides)},
        load=not args.no_load,
        profile=args.profile,
        profile_trace=args.profile_trace,
        telemetry=not args.no_telemetry,
    )


def _child_main(task_json: str, result_json: str) -> int:
    from bench.harness import Task, make_checkpoint, run_interleaved, run_task

    task = json.loads(Path(task_json).read_text())
    if task.get("kind") == "checkpoint":
        result = make_checkpoint(Path(task["hf_dir"]))
    elif task.get("kind") == "interleaved":
        result = {"results": run_interleaved(Task.from_dict(task["task"]), task["variants"])}
    else:
        result = run_task(Task.from_dict(task))
    Path(result_json).write_text(json.dumps(result, indent=1, default=str))
    return 0


def _time_left(args, wanted: float) -> float | None:
    """Seconds a child may run: ``wanted``, cut to the --budget; None when the budget is used up."""
    if args.budget is None:
        return wanted
    left = args.budget - (time.monotonic() - args.started)
    return None if left < 30 else min(wanted, left - 10)


def _run_load_layout(name: str, hf_dir: Path, layout: str, args, log) -> dict:
    """bench/load.py under torchrun for one parallel layout (CPU ranks unless --load-on-gpu)."""
    import socket

    from bench.load import world_size

    base = {"shape": name, "layout": layout, "on_gpu": args.load_on_gpu}
    timeout = _time_left(args, args.variant_timeout)
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
    log.write(_tail_lines(output, 60))
    log.flush()
    if rc == 0 and out.exists():
        return base | {"status": "ok"} | json.loads(out.read_text())
    return base | {"status": "error", "error": f"torchrun exited {rc}", "log_tail": output[-3000:]}


def _run_child(payload: dict, name: str, args, log) -> dict:
    """Runs one task in a fresh interpreter; its output goes to the log."""
    timeout = _time_left(args, args.variant_timeout)
    if timeout is None:
        return {"status": "skipped", "reason": f"--budget {args.budget:.0f} s used up before this variant"}
    tmp = args.out / "tasks"
    tmp.mkdir(parents=True, exist_ok=True)
    task_file, result_file = tmp / f"{name}.task.json", tmp / f"{name}.result.json"
    task_file.write_text(json.dumps(payload, default=str))
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(task_file), str(result_file)]
    log.write(f"\n===== {name}: {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as err:
        output, rc = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), -9
        output += f"\n[timed out after {timeout:.0f} s]"
    log.write(_tail_lines(output, 200))
    log.flush()
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {
        "status": "error",
        "error": f"child process exited {rc} after {time.perf_counter() - t0:.0f} s without a result",
        "log_tail": output[-3000:],
    }


def _run_unit(task, variants: list[str], name: str, args, log) -> list[dict]:
    """One result per variant: ``task`` alone, or ``variants`` interleaved in one process."""
    from bench.harness import run_interleaved, run_task

    if not args.interleave:
        return [run_task(task) if args.in_process else _run_child(task.as_dict(), name, args, log)]
    if args.in_process:
        return run_interleaved(task, variants)
    payload = {"kind": "interleaved", "task": task.as_dict(), "variants": variants}
    got = _run_child(payload, name, args, log)
    return got["results"] if "results" in got else [dict(got) for _ in variants]


def _stamp(
    result: dict, shape: str, variant: str, settings, tag: str | None, command: str, doc: dict
) -> None:
    """What a row says of itself even when its child died before reporting it, and where it came from
    (command, date, tree: merged files mix them)."""
    defaults = {"shape": shape, "variant": variant, "label": variant, "seq_len": settings.seq_len}
    defaults |= {"micro_batch_size": settings.micro_batch_size, "tag": tag}
    for key, value in defaults.items():
        result.setdefault(key, value)
    result |= {
        "command": command,
        "date_utc": doc["date_utc"],
        "git_commit": doc["environment"]["git_commit"],
    }


def _tail_lines(text: str, n: int) -> str:
    lines = [ln for ln in text.splitlines() if "warnings.warn" not in ln and "UserWarning" not in ln]
    return "\n".join(lines[-n:]) + "\n"


def _key(r: dict) -> tuple:
    return (r.get("shape"), r.get("variant"), r.get("seq_len"), r.get("micro_batch_size"), r.get("tag", ""))


def _load_key(r: dict) -> tuple:
    return (r.get("shape"), r.get("layout"), r.get("on_gpu"))


def _load_previous(out: Path, fresh: bool) -> tuple[list[dict], list[dict]]:
    path = out / "results.json"
    if fresh or not path.exists():
        return [], []
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return [], []
    return old.get("results", []), old.get("load_scaling", [])


def write_outputs(doc: dict, out: Path) -> None:
    report.summarize(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    try:
        report.plot(doc, out / "results.png")
        doc.pop("plot_missing", None)
    except ImportError:
        doc["plot_missing"] = (
            "matplotlib is not installed here: render the PNG elsewhere with "
            "`python bench/run.py --report-only --out DIR` (pip install -e .[bench])"
        )
        print(f"[bench] {doc['plot_missing']}", flush=True)
    (out / "results.md").write_text(report.markdown(doc))
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    profiles = sorted(out.glob("profile-*.txt"))
    if profiles:
        (out / "profile.txt").write_text("\n".join(p.read_text() for p in profiles))


def export(out: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:
        if (out / name).exists():
            shutil.copy2(out / name, dest / name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.started = time.monotonic()
    if args.child:
        return _child_main(*args.child)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        sources = ([args.out / "results.json"] if (args.out / "results.json").exists() else []) + args.merge
        if not sources:
            raise SystemExit(f"--report-only: no {args.out / 'results.json'} and nothing to --merge")
        doc = json.loads(sources[0].read_text())
        merged = {_key(r): r for src in sources for r in json.loads(src.read_text())["results"]}
        doc["results"] = list(merged.values())
        loads = {
            _load_key(r): r for src in sources for r in json.loads(src.read_text()).get("load_scaling", [])
        }
        doc["load_scaling"] = list(loads.values())
        devices = {json.loads(src.read_text())["environment"].get("device") for src in sources}
        if len(devices) > 1:
            print(f"[bench] warning: merged results come from different devices: {sorted(devices)}")
            doc["environment"]["device"] = " / ".join(sorted(d for d in devices if d))
        write_outputs(doc, args.out)
        if args.export:
            export(args.out, args.export)
        print((args.out / "results.md").read_text())
        return 0

    import torch

    on_gpu = torch.cuda.is_available()
    pinning = pin_to_gpu_numa_node() if on_gpu and not args.no_pin else "not pinned (--no-pin or no GPU)"
    print(f"[bench] CPU affinity: {pinning}", flush=True)
    settings = _settings(args, on_gpu)
    layers = _layers(args)
    command = "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = {
        "schema_version": report.SCHEMA_VERSION,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "environment": environment(args.in_process, args.out) | {"cpu_pinning": pinning},
        "settings": settings.__dict__,
        "flop_formula": {
            "full": "6*N*T + 3*A",
            "lora": "4*N*T + 6*N_lora*T + 3*A",
            "frozen": "4*N*T + 3*A",
            "A": "2 * layers * seq_len * heads * head_dim * T (causal attention core, forward)",
            "N": "matmul weights per token incl. output layer; MoE: router + top-k experts (+ shared)",
        },
    }
    from bench.flops import peak_flops

    doc["peak_flops_per_gpu"] = peak_flops(doc["environment"]["device"]) if on_gpu else None
    previous, previous_loads = _load_previous(args.out, args.fresh)
    fresh_results: list[dict] = []
    fresh_loads: list[dict] = []
    doc["results"], doc["load_scaling"] = list(previous), list(previous_loads)
    with open(args.out / "run.log", "a") as log:
        log.write(f"\n##### {doc['date_utc']} {command}\n")
        for shape in args.shapes:
            name = shape_name(shape, layers.get(shape))
            hf_dir = write_config(shape, layers.get(shape), args.work / name)
            needs_ckpt = settings.load and "twinkle_full" in args.variants
            if needs_ckpt and not any(hf_dir.glob("*.safetensors")):
                print(f"[bench] {name}: writing a random-weight HF checkpoint to {hf_dir}", flush=True)
                payload = {"kind": "checkpoint", "hf_dir": str(hf_dir)}
                if args.in_process:
                    from bench.harness import make_checkpoint

                    info = make_checkpoint(hf_dir)
                else:
                    info = _run_child(payload, f"{name}__checkpoint", args, log)
                print(f"[bench] {name}: checkpoint {info}", flush=True)
            # one unit per child process: a variant, or with --interleave all of them together
            units = [[v] for v in args.variants] if not args.interleave else [list(args.variants)]
            for repeat, variants in [(r, u) for r in range(args.repeats) for u in units]:
                from bench.harness import Task

                task = Task(name, variants[0], str(hf_dir), settings, str(args.out), args.tag)
                suffix = (f"__{args.tag}" if args.tag else "") + (f"__r{repeat}" if repeat else "")
                if repeat:
                    task.settings = dataclasses.replace(settings, load=False, profile=False)
                unit = f"{name}__{'+'.join(variants)}{suffix}"
                print(f"[bench] {unit} ...", flush=True)
                for variant, result in zip(variants, _run_unit(task, variants, unit, args, log), strict=True):
                    tag = f"{name}__{variant}{suffix}"
                    _stamp(result, name, variant, settings, args.tag, command, doc)
                    earlier = [r for r in fresh_results if _key(r) == _key(result)]
                    if earlier:
                        combine_repeat(earlier[0], result)
                    else:
                        result["repeats"] = 1
                        fresh_results.append(result)
                    print(f"[bench] {tag}: {_one_line(result)}", flush=True)
                    log.write(f"[bench] {tag}: {_one_line(result)}\n")
                    log.flush()
                # write after every unit: a call cut short still leaves what it measured
                keys = {_key(r) for r in fresh_results}
                doc["results"] = [r for r in previous if _key(r) not in keys] + fresh_results
                write_outputs(doc, args.out)
                if args.export:
                    export(args.out, args.export)
            has_ckpt = settings.load and any(hf_dir.glob("*.safetensors"))
            for layout in args.load_layouts if has_ckpt else []:
                print(f"[bench] {name} load {layout} ...", flush=True)
                row = _run_load_layout(name, hf_dir, layout, args, log)
                row |= {"command": command, "date_utc": doc["date_utc"]}
                fresh_loads.append(row)
                msg = (
                    f"{row['ranks']} ranks, {row['seconds_all_ranks']:.2f} s, max read/rank "
                    f"{row['max_read_fraction_per_rank']:.3f} of the checkpoint"
                    if row["status"] == "ok"
                    else f"{row['status']}: {row.get('reason') or row.get('error')}"
                )
                print(f"[bench] {name} load {layout}: {msg}", flush=True)
                log.write(f"[bench] {name} load {layout}: {msg}\n")
                keys = {_load_key(r) for r in fresh_loads}
                doc["load_scaling"] = [r for r in previous_loads if _load_key(r) not in keys] + fresh_loads
                write_outputs(doc, args.out)
                if args.export:
                    export(args.out, args.export)
    print((args.out / "results.md").read_text(), flush=True)
    return 0


def combine_repeat(first: dict, again: dict) -> None:
    """Folds a repeated run of the same variant into ``first``: all step times pooled (median and
    spread over them, phase spans too), each run's median kept in ``repeat_medians``, memory the larger
    peak."""
    from bench.stats import spread

    if first.get("status") != "ok" or again.get("status") != "ok":
        first.setdefault("repeat_errors", []).append(
            again.get("error") or again.get("reason") or again["status"]
        )
        if first.get("status") != "ok" and again.get("status") == "ok":
            first.clear()
            first.update(again | {"repeats": 1})
        return
    first.setdefault("repeat_medians", [first["step_time_s"]["median"]])
    first["repeat_medians"].append(again["step_time_s"]["median"])
    first["repeats"] = first.get("repeats", 1) + 1
    times = first["step_time_s"]["all"] + again["step_time_s"]["all"]
    first["step_time_s"] = spread(times)
    phases, more = first.get("phase_time_s") or {}, again.get("phase_time_s") or {}
    for name in phases.keys() & more.keys():
        phases[name] = spread(phases[name]["all"] + more[name]["all"])
    first["losses"] = first["losses"] + again["losses"]
    first["losses_finite"] = first["losses_finite"] and again["losses_finite"]
    for key in ("peak_memory_gib", "peak_reserved_gib", "step_memory_gib"):
        if first.get(key) is not None and again.get(key) is not None:
            first[key] = max(first[key], again[key])
    median = first["step_time_s"]["median"]
    first["tokens_per_s_per_gpu"] = first["tokens_per_step"] / median
    first["tflops_per_s_per_gpu"] = first["model_flops"]["total"] / median / 1e12
    peak = first.get("peak_flops_per_gpu")
    first["mfu"] = first["model_flops"]["total"] / median / peak if peak else None


def _one_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r.get('status')}: {r.get('reason') or r.get('error')}"
    mfu = r.get("mfu")
    mem = r.get("peak_memory_gib")
    return (
        f"{r['tokens_per_s_per_gpu']:,.0f} tok/s, step {r['step_time_s']['median'] * 1e3:.1f} ms "
        f"(min {r['step_time_s']['min'] * 1e3:.1f}, max {r['step_time_s']['max'] * 1e3:.1f})"
        + (f", MFU {mfu:.1%}" if mfu is not None else "")
        + (f", peak {mem:.2f} GiB" if mem is not None else "")
        + _phases(r)
    )


def _phases(r: dict) -> str:
    """Median span of each phase on the GPU timeline (see harness.PhaseClock)."""
    phases = r.get("phase_time_s") or {}
    return "".join(f", {name} {t['median'] * 1e3:.1f}" for name, t in phases.items()) + (
        " ms" if phases else ""
    )


if __name__ == "__main__":
    sys.exit(main())
