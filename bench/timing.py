"""Timing complete training iterations: warm-up, then timed steps of one variant or several in turn,
with per-step CUDA-event times, each step split into phases (:class:`PhaseClock`), the peak memory
(:mod:`.memory`) and the GPU's clocks (:mod:`.telemetry`)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any

import torch
from torch.profiler import record_function

from . import memory, telemetry
from .device import device, on_gpu, sync
from .stats import spread


class PhaseClock:
    """Where each step's time goes on the GPU's timeline, without a profiler or a host sync.

    ``phase(name)`` opens a ``record_function`` range (what the profiler shows) and, while timing, records
    a CUDA event where the phase's work enters the stream. The GPU stamps an event once it has finished
    everything queued before it, or when it is queued if the GPU was idle by then, so the span from one
    phase's event to the next is that phase's stretch of the GPU timeline, including the time the GPU
    waited for the host to queue it (a host-bound phase shows as a span longer than its kernels).
    """

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, Any]]] | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.steps is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.steps[-1].append((name, event))
        with record_function(name):
            yield

    @staticmethod
    def spans(steps: list[list[tuple[str, Any]]], ends: list) -> dict[str, dict[str, Any]]:
        """Per phase, its spans over the recorded ``steps`` (seconds); ``ends[i]`` ends step ``i``'s last
        phase."""
        per_phase: dict[str, list[float]] = {}
        for marks, end in zip(steps, ends, strict=True):
            stops = [e for _, e in marks[1:]] + [end]
            for (name, start), stop in zip(marks, stops, strict=True):
                per_phase.setdefault(name, []).append(start.elapsed_time(stop) / 1e3)
        return {name: spread(v) for name, v in per_phase.items()}


CLOCK = PhaseClock()  # the build functions' steps mark their phases on it


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic GC off while timing, as megatron's --manual-gc does in pretrain_gpt.py: a gen-2
    collection over a model's worth of objects lands in a random step (host-bound MoE steps varied
    ±25 % between runs without this); the same for every variant."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def median_cuda_ms(fn, iters: int, warmup: int = 0) -> float:
    """Median ms of ``fn()`` by CUDA events around each call, after ``warmup`` untimed calls: for an op or
    a few of them, not a training step (:func:`time_steps`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued_cuda_ms(fn, iters: int, warmup: int = 0) -> float:
    """Mean ms of ``fn()`` on the device: the ``iters`` calls are queued behind a sleep kernel, so the host's
    time to launch them (Python work per call, such as TE attention's backend selection) is not timed, as
    under CUDA graphs; :func:`median_cuda_ms` times each call from the host's side."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000 * iters)  # ~1 ms of cycles per queued call
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_steps(step, warmup: int, steps: int, sample_gpu: bool = True) -> dict[str, Any]:
    """Runs ``warmup`` untimed and ``steps`` timed iterations of one variant (:func:`time_interleaved`
    with nothing to interleave). Returns per-step and per-phase times, the wall time of the timed loop,
    peak memory, losses and (``sample_gpu``) the GPU's clocks per step."""
    return time_interleaved({"": step}, warmup, steps, sample_gpu)[""]


def interleaved_order(names: list[str], round_: int) -> list[str]:
    """Round ``round_``'s order: as given, then reversed (a b, b a, a b, ...), so no variant always
    steps right after another one's step (the caches, allocator and clocks it leaves behind)."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def _gpu_sampler() -> telemetry.Sampler:
    """nvidia-smi sampling of this process's GPU, named by UUID (CUDA_VISIBLE_DEVICES may renumber)."""
    uuid = str(torch.cuda.get_device_properties(device()).uuid)
    return telemetry.Sampler(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}").start()


def time_interleaved(
    steps: dict[str, Any], warmup: int, n: int, sample_gpu: bool = True
) -> dict[str, dict[str, Any]]:
    """Times one or several variants in one process, one step of each per round
    (:func:`interleaved_order`), without a host sync between timed steps.

    Separate processes on a VM can differ in host speed by tens of percent on host-bound shapes
    (identical runs of (a) did), which drowns a 2 % comparison; step by step in one process, that
    drift falls on every variant alike. On a GPU each step is timed from a CUDA event before it to one
    after it, and :class:`PhaseClock` splits it into forward / backward / optimizer. Memory figures are
    the process's, with every variant's model resident. With ``sample_gpu`` on a GPU, the SM clock and
    power during each step (:mod:`.telemetry`)."""
    names = list(steps)
    losses: dict[str, list[float]] = {v: [] for v in names}
    for i in range(warmup):
        for v in interleaved_order(names, i):
            losses[v].append(float(steps[v]()))
    sync()
    clocks: dict[str, list] = {v: [] for v in names}
    marks: dict[str, list[tuple[Any, Any]]] = {v: [] for v in names}
    outs: dict[str, list] = {v: [] for v in names}

    def mark():
        if not on_gpu():
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    sampler = _gpu_sampler() if sample_gpu and on_gpu() else None
    with gc_paused():
        mem_before = memory.reset_peak()
        t0 = time.perf_counter()
        ref = mark()  # on an idle GPU (synced above): fires at host time t0
        for i in range(n):
            for v in interleaved_order(names, i):
                start = mark()
                if on_gpu():
                    CLOCK.steps = clocks[v]
                    CLOCK.steps.append([])
                outs[v].append(steps[v]())
                marks[v].append((start, mark()))
        CLOCK.steps = None
        sync()
        wall = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()
    peak = memory.peak(mem_before, one_variant=len(names) == 1)
    results = {}
    for v in names:
        result: dict[str, Any] = {"timed_wall_s": wall, "gc": "off while timed"} | peak
        if on_gpu():
            times = [a.elapsed_time(b) / 1e3 for a, b in marks[v]]
            result["phase_time_s"] = PhaseClock.spans(clocks[v], [b for _, b in marks[v]])
            if sampler is not None:
                at = [(t0 + ref.elapsed_time(a) / 1e3, t0 + ref.elapsed_time(b) / 1e3) for a, b in marks[v]]
                result["gpu_telemetry"] = telemetry.summary(sampler, at)
        else:
            times = [b - a for a, b in marks[v]]
        result |= {"step_time_s": spread(times), "losses": losses[v] + [float(x) for x in outs[v]]}
        if len(names) > 1:
            result["interleaved_with"] = names
        results[v] = result
    return results
