"""Small statistics helpers shared by the bench processes (no numpy: workers start fast)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/p99.9/mean/min/max in milliseconds of samples given in seconds."""
    values = sorted(samples_s)
    if not values:
        return {"n": 0}
    ms = 1e3
    return {
        "n": len(values),
        "p50_ms": round(percentile(values, 50) * ms, 4),
        "p90_ms": round(percentile(values, 90) * ms, 4),
        "p99_ms": round(percentile(values, 99) * ms, 4),
        "p999_ms": round(percentile(values, 99.9) * ms, 4),
        "mean_ms": round(sum(values) / len(values) * ms, 4),
        "min_ms": round(values[0] * ms, 4),
        "max_ms": round(values[-1] * ms, 4),
    }


def median_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """n, median, min and max in milliseconds of a few samples given in seconds (interleaved
    reps, too few for percentiles)."""
    return {
        "n": len(samples_s),
        "median_ms": round(statistics.median(samples_s) * 1e3, 3),
        "min_ms": round(min(samples_s) * 1e3, 3),
        "max_ms": round(max(samples_s) * 1e3, 3),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def reported_figure(
    figure: str, baseline: str, base_val: float | None, eng_val: float | None, unit: str = "ms", **extra: Any
) -> dict[str, Any]:
    """A figure with no target (reported only): the two values and their ratio, and `extra`
    fields (e.g. "floor")."""
    return {
        "figure": figure,
        "baseline": baseline,
        "baseline_value": base_val,
        "enginectl_value": eng_val,
        "unit": unit,
        "ratio": ratio(eng_val, base_val),
        "target": "reported (no target)",
        "met": None,
        **extra,
    }
