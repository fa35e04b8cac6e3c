"""``--profile``: the torch profiler over a few steps after timing. Per variant: device time by kernel
category, every kernel per step (what bench/kernel_diff.py compares), the GPU timeline's idle stretches
by phase, and cProfile of the host; written to ``profile-<tag>.txt``."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from .device import on_gpu, sync

# Kernel-name patterns -> category, for "where the time goes" (first match wins).
CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "sdpa", "scaled_dot_product", "cudnn")),
    (
        "gemm",
        (
            "gemm",
            "cutlass",
            "xmma",
            "cublas",
            "nvjet",
            "matmul",
            "wgrad",
            "dgrad",
            "aten::mm",
            "addmm",
            "bmm",
        ),
    ),
    ("cross_entropy", ("cross_entropy", "log_softmax", "softmax", "nll")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm", "clip")),
    ("norm_rope_act", ("rmsnorm", "norm", "rope", "rotary", "swiglu", "silu", "gelu")),
    ("moe_routing", ("permute", "topk", "sort", "scatter", "gather", "index", "histc", "bincount")),
    ("copy_cast", ("copy", "cast", "convert", "fill", "zero")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "mul", "add")),
)


RANGES = ("forward", "backward", "optimizer")  # record_function ranges of every step
STACK_DEPTH = 6  # Python frames that name an operator's call site in the --profile-stacks table


def categorize(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_steps(step, n: int, out_dir: Path, tag: str, trace: bool, stacks: bool = False) -> dict[str, Any]:
    """Profiles ``n`` iterations; writes the top-kernel table to ``profile-<tag>.txt`` (and a chrome
    trace with ``trace``; with ``stacks``, the device time of each operator by its Python call site, which
    tells what launched a copy) and returns the device-time breakdown by category and busy vs wall time."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu() else [])
    sync()
    t0 = time.perf_counter()
    # torch keeps Python call sites for the table only with its verbose experimental config
    verbose = {"experimental_config": _ExperimentalConfig(verbose=True)} if stacks else {}
    with profile(activities=activities, record_shapes=False, with_stack=stacks, **verbose) as prof:
        for _ in range(n):
            step()
        sync()
    wall = time.perf_counter() - t0
    gc.enable()
    gc.unfreeze()
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if on_gpu() else "self_cpu_time_total"
    table = averages.table(sort_by=sort_key, row_limit=40)
    by_cat: dict[str, float] = {}
    kernels: list[tuple[float, int, str]] = []  # every kernel (self device time per step), for diffs
    device_total = 0.0
    for ev in averages:
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if not on_gpu():
            t = ev.self_cpu_time_total
        if t <= 0 or (on_gpu() and str(getattr(ev, "device_type", "")).endswith("CPU")):
            continue
        if ev.key in RANGES or ev.key.startswith("Optimizer."):
            continue  # annotations (ours, torch.optim's) span kernels that are counted themselves
        device_total += t
        kernels.append((t / 1e3 / n, ev.count, ev.key))
        cat = categorize(ev.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + t
    per_step_ms = {k: v / 1e3 / n for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    busy_ms = device_total / 1e3 / n
    wall_ms = wall * 1e3 / n
    summary = {
        "steps": n,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "device_busy_fraction": busy_ms / wall_ms if wall_ms else None,
        "device_ms_per_step_by_category": per_step_ms,
        "note": "device time is summed kernel time (self); busy fraction well below 1 means host-bound"
        if on_gpu()
        else "CPU run: times are host self-time of operators",
    }
    gaps = timeline_gaps(prof.events(), n) if on_gpu() else None
    if gaps:
        summary["device_idle"] = {k: v for k, v in gaps.items() if k != "largest"}
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"== {tag}", f"wall {wall_ms:.1f} ms/step, device busy {busy_ms:.1f} ms/step"]
    lines += [f"  {k:<16} {v:9.2f} ms/step" for k, v in per_step_ms.items()]
    if gaps:
        lines += _gap_lines(gaps)
    cpu_table = averages.table(sort_by="cpu_time_total", row_limit=25)
    host = _host_profile(step, n)
    by_site = []
    if stacks:
        sites = prof.key_averages(group_by_stack_n=STACK_DEPTH).table(
            sort_by=sort_key, row_limit=60, max_name_column_width=60, max_src_column_width=90
        )
        by_site = [f"device time by operator and call site (innermost {STACK_DEPTH} frames):\n{sites}"]
    text = "\n\n".join(
        [
            "\n".join(lines),
            table,
            *by_site,
            "host (CPU) time, by operator and range (forward/backward/optimizer):\n" + cpu_table,
            f"host Python functions, cProfile over {n} more steps (by own time):\n{host}",
            f"every device kernel over {n} steps (ms per step, calls in all, name):\n"
            + "\n".join(f"{ms:9.3f} {calls:6d}  {name}" for ms, calls, name in sorted(kernels, reverse=True)),
        ]
    )
    (out_dir / f"profile-{tag}.txt").write_text(text + "\n")
    if trace:
        prof.export_chrome_trace(str(out_dir / f"trace-{tag}.json"))
        summary["trace"] = f"trace-{tag}.json"
    return summary


SHORT_GAP_US = 20.0  # idle stretches below this are launch gaps between queued kernels (in a CUDA graph)


def timeline_gaps(events, n: int) -> dict[str, Any] | None:
    """Where the GPU sat idle over the profiled steps, from the kernels' (and copies') start and end
    times: the idle time per step inside each phase range (``RANGES``, by the GPU side of its
    annotation), split into short gaps (under ``SHORT_GAP_US``: the GPU between two queued kernels) and
    long ones (the GPU waiting for the host), and the longest gaps with the kernels either side. The
    summed kernel time of the table above double-counts nothing but says nothing of this."""
    spans, phases = [], []
    for ev in events:
        if not str(getattr(ev, "device_type", "")).endswith("CUDA"):
            continue
        start, end = ev.time_range.start, ev.time_range.end
        if ev.name in RANGES:
            phases.append((start, end, ev.name))
        elif ev.name != "Activity Buffer Request" and not ev.name.startswith("Optimizer.") and end > start:
            spans.append((start, end, ev.name))
    if not spans:
        return None
    spans.sort()
    idle: dict[str, list[float]] = {}
    largest: list[tuple[float, str, str, str]] = []
    reach, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            gap = start - reach
            mid = (start + reach) / 2
            phase = next((p for a, b, p in phases if a <= mid <= b), "between ranges")
            kind = "short" if gap < SHORT_GAP_US else "long"
            slot = idle.setdefault(f"{phase} {kind}", [0.0, 0])
            slot[0] += gap
            slot[1] += 1
            largest.append((gap, phase, last, name))
        if end >= reach:
            reach, last = end, name
    largest.sort(reverse=True)
    total = sum(v[0] for v in idle.values())
    return {
        "span_ms_per_step": (reach - spans[0][0]) / 1e3 / n,
        "idle_ms_per_step": total / 1e3 / n,
        "by_phase_ms_per_step": {k: v[0] / 1e3 / n for k, v in sorted(idle.items())},
        "gaps_per_step": {k: v[1] / n for k, v in sorted(idle.items())},
        "largest": [
            {"us": round(g, 1), "phase": p, "after": a[:70], "before": b[:70]} for g, p, a, b in largest[:12]
        ],
    }


def _gap_lines(gaps: dict[str, Any]) -> list[str]:
    lines = [
        f"GPU timeline: {gaps['span_ms_per_step']:.2f} ms/step from first to last kernel, "
        f"idle {gaps['idle_ms_per_step']:.2f} ms/step (short gaps < {SHORT_GAP_US:.0f} us):"
    ]
    for k, ms in gaps["by_phase_ms_per_step"].items():
        lines.append(f"  idle {k:<26} {ms:7.3f} ms/step in {gaps['gaps_per_step'][k]:7.1f} gaps")
    lines.append("  longest gaps (us, range, kernel before -> kernel after):")
    lines += [f"    {g['us']:8.1f}  {g['phase']:<10} {g['after']} -> {g['before']}" for g in gaps["largest"]]
    return lines


def _host_profile(step, n: int) -> str:
    """cProfile of ``n`` steps: where the host's time goes when the GPU waits on it (launch-bound)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    buf.write("\nmegatron's optimizer and DDP calls, by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(
        r"megatron/core/(optimizer|distributed)|transformer_engine/pytorch/optimizers", 40
    )
    return buf.getvalue()
