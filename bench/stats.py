"""Small statistics for repeated measurements: median with spread, percentiles."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """Median, min and max of repeated measurements (``None`` when there are none)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (numpy's default method)."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99), scale: float = 1.0) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ..., "mean": ...}`` of ``values * scale``."""
    out: dict[str, float | None] = {}
    for q in qs:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else p * scale
    out["mean"] = statistics.fmean(values) * scale if values else None
    return out


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median: the order statistics
    ``(x_(k), x_(n+1-k))`` with the largest ``k`` whose coverage, ``1 - 2 P(Binomial(n, 1/2) <
    k)``, is at least ``level`` (10 values at 95%: the 2nd and 9th smallest, 97.9%). None when
    even the smallest and largest cover less (fewer than 6 values at 95%)."""
    n = len(values)
    tail = 0.0  # P(Binomial(n, 1/2) < k)
    k = 0
    while k < n // 2:
        next_tail = tail + math.comb(n, k) / 2**n
        if 1 - 2 * next_tail < level:
            break
        tail, k = next_tail, k + 1
    if k == 0:
        return None
    data = sorted(values)
    return data[k - 1], data[n - k]
