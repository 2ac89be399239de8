"""bench/stats.py's interval for a median and bench/report.py's speedup grid built on it."""

from __future__ import annotations

import math

import pytest

from bench.report import speedup_grid
from bench.stats import median_interval


@pytest.mark.parametrize(("n", "k"), [(6, 1), (8, 1), (10, 2), (16, 4), (40, 14)])
def test_the_median_interval_is_the_widest_pair_of_order_statistics_needed_for_95_percent(n: int, k: int) -> None:
    """``(x_(k), x_(n+1-k))`` covers the median with probability ``1 - 2 P(Bin(n, 1/2) < k)``:
    at least 95% for the ``k`` returned, below it for ``k + 1``."""
    values = [float(v) for v in range(n, 0, -1)]  # any order
    assert median_interval(values) == (float(k), float(n + 1 - k))

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

    assert coverage(k) >= 0.95 > coverage(k + 1)


def test_too_few_rounds_give_no_interval() -> None:
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([]) is None


def _run(label: str, t: float, b: int, speedups: list[float], mode: str = "adaptive") -> dict:
    return {"mode": mode, "label": label, "temperature": t, "batch_size": b,
            "speedup_vs_ar": sorted(speedups)[len(speedups) // 2], "round_speedups": speedups}  # fmt: skip


def test_the_grid_bolds_only_a_median_whose_whole_interval_is_below_one() -> None:
    """Session 35's T=0.7 batch-128 point: ten rounds at 0.92-0.99 are a slowdown (bold); ten
    rounds straddling 1.0 are not told apart from it; five rounds give no interval."""
    runs = [
        _run("adaptive", 0.7, 128, [0.925, 0.917, 0.977, 0.991, 0.974, 0.949, 0.98, 0.983, 0.96, 0.95]),
        _run("adaptive", 0.7, 256, [0.6, 0.89, 0.97, 1.07, 0.92, 0.94, 1.2, 0.93, 1.01, 0.98]),
        _run("adaptive", 0.0, 1, [2.3, 2.4, 2.2, 2.5, 2.35]),
        _run("ar", 0.0, 1, [1.0] * 10, mode="ar"),
    ]
    lines = speedup_grid(runs)
    assert lines[2] == "| mode | T | 1 | 128 | 256 |"
    assert lines[4] == "| adaptive | 0 | 2.35 | – | – |"
    assert lines[5] == "| adaptive | 0.7 | – | **0.97 [0.93–0.98]** | 0.97 [0.89–1.07] |"
    assert speedup_grid([runs[-1]]) == []
