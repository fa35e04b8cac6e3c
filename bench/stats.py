"""Summary statistics of per-step measurements, shared by the harness, run.py and the report (no torch)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def spread(values: list[float]) -> dict[str, Any]:
    """Median and spread of per-step times (seconds)."""
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": pct(0.1),
        "p90": pct(0.9),
        "std": statistics.pstdev(values),
        "all": values,
    }
