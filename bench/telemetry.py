"""The GPU's SM clock, power, temperature and clock-event reasons while steps are timed.

Why: a GPU at a power or thermal limit lowers its clock, and a step's time moves with it. On the H200
the LoRA step (55 % MFU) ran 65 ms in its first timed step and 70-71 ms after, while the HF step
(28 % MFU) stayed flat. With the clock recorded per step, a
result says whether a slower step was the code or the GPU.

``nvidia-smi`` samples in loop mode (every ``period_ms``) in a child process; each line is stamped with
the host clock when it arrives. The harness turns its CUDA-event step times into host-clock windows
(the first event is recorded on an idle GPU right after a sync, so it fires at its host time) and
:func:`per_step` averages the samples inside each window. Where ``nvidia-smi`` is missing or fails, the
result says so (``available: False`` and the reason); timing goes on without it.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

# nvidia-smi's clock-event reasons bitmask (nvml.h, nvmlClocksEventReason*)
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# field sets, newest first: drivers before R535 name the reasons "throttle", older ones lack the
# instantaneous power reading
FIELD_SETS = (
    "clocks.sm,clocks.mem,power.draw.instant,temperature.gpu,clocks_event_reasons.active",
    "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active",
    "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
)


@dataclass(frozen=True)
class Sample:
    t: float  # host perf_counter seconds
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temp_c: float
    reasons: int


def parse_line(line: str, t: float) -> Sample | None:
    """One ``--format=csv,noheader,nounits`` line of :data:`FIELD_SETS`; None for anything else (a value
    the driver reports as ``[N/A]``, an error message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        sm, mem, power, temp = (float(p) for p in parts[:4])
        reasons = int(parts[4], 16)
    except ValueError:
        return None
    return Sample(t, sm, mem, power, temp, reasons)


def decode_reasons(mask: int) -> list[str]:
    """Names of the bits set in a clock-event reasons mask (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


class Sampler:
    """``nvidia-smi`` in loop mode for one GPU (``gpu``: an index or ``GPU-<uuid>``), read on a thread."""

    def __init__(self, gpu: str, period_ms: int = 20, binary: str = "nvidia-smi") -> None:
        self.gpu, self.period_ms, self.binary = gpu, period_ms, binary
        self.samples: list[Sample] = []
        self.error: str | None = None
        self.fields: str | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _command(self, fields: str, loop: bool) -> list[str]:
        cmd = [self.binary, "-i", self.gpu, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
        return cmd + ([f"--loop-ms={self.period_ms}"] if loop else [])

    def start(self) -> Sampler:
        """Picks the first field set this driver answers (one query each), then starts the loop."""
        path = shutil.which(self.binary)
        if path is None:
            self.error = f"{self.binary} not found on PATH"
            return self
        for fields in FIELD_SETS:
            try:
                probe = subprocess.run(
                    self._command(fields, False), capture_output=True, text=True, timeout=20
                )
            except (OSError, subprocess.TimeoutExpired) as err:
                self.error = f"{self.binary} failed: {err}"
                return self
            if probe.returncode == 0 and parse_line(probe.stdout.strip(), 0.0):
                self.fields = fields
                break
            self.error = (
                f"{self.binary} answered {probe.returncode}: {(probe.stdout + probe.stderr).strip()[:200]}"
            )
        if self.fields is None:
            return self
        self.error = None
        self._proc = subprocess.Popen(
            self._command(self.fields, True), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        deadline = time.perf_counter() + 5.0  # the loop's first line: steps timed from here get samples
        while not self.samples and time.perf_counter() < deadline and self._proc.poll() is None:
            time.sleep(0.01)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_line(line, time.perf_counter())
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> list[Sample]:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.samples


def per_step(samples: list[Sample], windows: list[tuple[float, float]]) -> list[dict[str, Any] | None]:
    """Per host-clock window, the mean SM clock and power, the highest temperature and the share of the
    samples inside it that had each reason; None for a window no sample fell in (shorter than the
    period)."""
    out: list[dict[str, Any] | None] = []
    for lo, hi in windows:
        inside = [s for s in samples if lo <= s.t <= hi]
        if not inside:
            out.append(None)
            continue
        out.append(
            {
                "samples": len(inside),
                "sm_mhz": statistics.fmean(s.sm_mhz for s in inside),
                "power_w": statistics.fmean(s.power_w for s in inside),
                "temp_c": max(s.temp_c for s in inside),
                "reasons": _shares(inside),
            }
        )
    return out


def _shares(samples: list[Sample]) -> dict[str, float]:
    """Each reason seen, with the share of ``samples`` it was active in."""
    counts: dict[str, int] = {}
    for s in samples:
        for name in decode_reasons(s.reasons):
            counts[name] = counts.get(name, 0) + 1
    return {name: n / len(samples) for name, n in sorted(counts.items())}


def summary(sampler: Sampler, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """What a result records: per-step readings, their medians, each reason's share of the samples taken
    while timed, and the query used; or why there are none."""
    if sampler.error or sampler.fields is None:
        return {"available": False, "reason": sampler.error or "not started"}
    steps = per_step(sampler.samples, windows)
    seen = [s for s in steps if s]
    result: dict[str, Any] = {
        "available": True,
        "query": sampler.fields,
        "period_ms": sampler.period_ms,
        "steps_with_samples": len(seen),
        "per_step": steps,
    }
    if seen:
        inside = [s for lo, hi in windows for s in sampler.samples if lo <= s.t <= hi]
        result |= {
            "sm_mhz_median": statistics.median(s["sm_mhz"] for s in seen),
            "sm_mhz_min": min(s["sm_mhz"] for s in seen),
            "power_w_median": statistics.median(s["power_w"] for s in seen),
            "temp_c_max": max(s["temp_c"] for s in seen),
            "reason_share": _shares(inside),
        }
    return result
