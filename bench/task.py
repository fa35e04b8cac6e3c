"""One unit of work in one process: a variant of a shape built (bench/variants.py), timed, measured,
profiled if asked, and its throughput, FLOPs and MFU derived. Errors are recorded, never raised, so the
other variants still run."""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import memory, report
from .device import on_gpu
from .environment import loaded_cudnn
from .flops import peak_flops, step_flops
from .profiling import profile_steps
from .settings import Prepared, Settings, lora_config
from .timing import time_interleaved, time_steps
from .variants import VARIANTS


@dataclass
class Task:
    """What a child process runs: one variant of one shape (``hf_dir``: its HF config and checkpoint)."""

    shape: str
    variant: str
    hf_dir: str
    settings: Settings
    out_dir: str
    tag: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        return cls(**(d | {"settings": Settings(**d["settings"])}))


def measure(prepared: Prepared, s: Settings, out_dir: Path, tag: str) -> dict[str, Any]:
    """Times a built variant's steps, then its activation memory and (``s.profile``) its profile."""
    result = prepared.result | time_steps(prepared.step, s.warmup, s.steps, s.telemetry)
    if prepared.activation_note:
        result["activation_memory_note"] = prepared.activation_note
    else:
        result |= memory.activation_memory(prepared.forward, prepared.backward_and_update)
    if s.profile:
        result["profile"] = profile_steps(
            prepared.step, s.profile_steps, out_dir, tag, s.profile_trace, s.profile_stacks
        )
    result["cudnn"] = loaded_cudnn()  # after the steps: the libraries they loaded
    return result


def _base(task: Task, variant: str) -> dict[str, Any]:
    s = task.settings
    return {
        "shape": task.shape,
        "variant": variant,
        "label": VARIANTS[variant].label,
        "tag": task.tag,
        "seq_len": s.seq_len,
        "micro_batch_size": s.micro_batch_size,
        "grad_accum": s.grad_accum,
        "tokens_per_step": s.seq_len * s.micro_batch_size * s.grad_accum,
        # a build's result never sets these three (it would override them)
        "peer": VARIANTS[variant].peer,
        "fp8": VARIANTS[variant].fp8 or None,
        "configuration_of": VARIANTS[variant].configuration_of,
        "dtype": s.dtype,
        "device": torch.cuda.get_device_name() if on_gpu() else "cpu",
    }


def _error(err: Exception) -> dict[str, Any]:
    return {
        "status": "error",
        "error": f"{type(err).__name__}: {err}",
        "traceback": traceback.format_exc()[-4000:],
    }


def run_task(task: Task) -> dict[str, Any]:
    """Runs one variant; never raises (errors are recorded in the result)."""
    s, hf_dir = task.settings, Path(task.hf_dir)
    variant = VARIANTS[task.variant]
    base = _base(task, task.variant)
    reason = variant.why_not(hf_dir, s)
    if reason:
        return base | {"status": "skipped", "reason": reason}
    name = f"{task.shape}__{task.variant}" + (f"__{task.tag}" if task.tag else "")
    t0 = time.perf_counter()
    try:
        measured = measure(variant.prepare(hf_dir, s), s, Path(task.out_dir), name)
    except Exception as err:  # noqa: BLE001  (recorded; the other variants still run)
        return base | _error(err)
    finally:
        memory.release()
    out = base | {"status": "ok", "wall_s": time.perf_counter() - t0} | measured
    return out | derived_metrics(out, hf_dir, s)


def run_interleaved(task: Task, variants: list[str]) -> list[dict[str, Any]]:
    """``variants`` built side by side in this process and timed step by step in turn
    (:func:`time_interleaved`); one result per variant, as :func:`run_task` gives. Errors while running
    are recorded in the results; settings that cannot be interleaved raise ValueError (run.py checks)."""
    s, hf_dir = task.settings, Path(task.hf_dir)
    if s.load or s.profile or s.cuda_graphs != "none" or not all(VARIANTS[v].interleavable for v in variants):
        raise ValueError("interleaving times Megatron variants, eager, without load timing or profiler")
    skipped = {v: reason for v in variants if (reason := VARIANTS[v].why_not(hf_dir, s))}
    runnable = [v for v in variants if v not in skipped]
    results = {v: _base(task, v) | {"status": "skipped", "reason": r} for v, r in skipped.items()}
    t0 = time.perf_counter()
    try:
        prepared = {v: VARIANTS[v].prepare(hf_dir, s) for v in runnable}
        timed = time_interleaved({v: p.step for v, p in prepared.items()}, s.warmup, s.steps, s.telemetry)
    except Exception as err:  # noqa: BLE001  (recorded, as run_task does)
        results |= {v: _base(task, v) | _error(err) for v in runnable}
        return [results[v] for v in variants]
    finally:
        memory.release()
    wall = time.perf_counter() - t0
    for v in runnable:
        out = _base(task, v) | {"status": "ok", "wall_s": wall} | prepared[v].result | timed[v]
        out["activation_memory_note"] = "not measured when interleaved (every variant's model is resident)"
        results[v] = out | derived_metrics(out, hf_dir, s)
    return [results[v] for v in variants]


def derived_metrics(r: dict[str, Any], hf_dir: Path, s: Settings) -> dict[str, Any]:
    """tokens/s/GPU, model FLOPs, TFLOP/s and MFU from the median step time; for a packed row
    (``sequence_lengths`` in the result) on its conversations' tokens only."""
    from twinkle_specs.hf_config import qwen_arch_from_hf

    arch = qwen_arch_from_hf(hf_dir)
    mode = VARIANTS[r["variant"]].mode
    flops = step_flops(
        arch,
        seq_len=s.seq_len,
        micro_batch_size=s.micro_batch_size * s.grad_accum,
        mode=mode,
        lora=lora_config(s, hf_dir) if mode == "lora" else None,
        sequence_lengths=r.get("sequence_lengths"),
    )
    median = r["step_time_s"]["median"]
    peak = peak_flops(r["device"]) if r["device"] != "cpu" else None
    achieved = flops.total / median
    # the count published cards use: 6 x N x T for every variant (as if every weight were trained,
    # attention left out), beside the LoRA-aware count above
    six_n = 6.0 * flops.matmul_weights * flops.tokens / median
    return {
        "tokens_counted": report.TOKENS_COUNTED["useful" if "useful_tokens_per_step" in r else "all"],
        "tokens_per_s_per_gpu": report.counted_tokens(r) / median,
        "model_flops": flops.as_dict(),
        "tflops_per_s_per_gpu": achieved / 1e12,
        "peak_flops_per_gpu": peak,
        "mfu": achieved / peak if peak else None,
        "tflops_6n_per_s_per_gpu": six_n / 1e12,
        "mfu_6n": six_n / peak if peak else None,
        "losses_finite": all(math.isfinite(x) for x in r["losses"]),
    }
