"""What catching the MTP modules up over L rows costs: a fixed part plus a part per row.

A catch-up runs each MTP module once, eagerly, over every row the modules are behind (the prompts
of new requests, the tokens of autoregressive steps). On an H200 with the ``gpu`` preset it took
13 ms for one prompt of 64 rows, 31 ms for 16 prompts (1024 rows), 46 ms for 64 and 128 ms for
256 (``bench/results/h200-2026-12-01-catch-up.json``): about 12 ms of launches and host work
plus 7 us per row. A cost per row measured on one prompt (0.2 ms) would put the catch-up of 16
prompts at 210 ms, seven times too dear, and adaptive speculation would never switch to drafting
at batch 16, where drafting wins.

So the cost is ``fixed + per_row * L``, fitted to the catch-ups measured (the last
``CATCH_UP_WINDOW``) and to start-up calibration points (``calibrate_catch_up`` in
``engine.spec.adaptive``: catch-ups of 1 and 16 prompts over scratch blocks), by the Theil-Sen
estimator: the slope is the median of the slopes between pairs of points of different sizes,
the fixed part the median of what each point leaves beyond that slope. A median is robust to a
stall (a garbage collection, a kernel compiled for a new shape) and to a catch-up timed short.
With points of one size only, the cost is proportional to the rows, at their lower median cost
per row (the previous model: dear for larger catch-ups, never cheaper than measured).

Where the start-up calibration spans two sizes, the slope is the calibration's alone, and the
catch-ups measured in served steps move the fixed part only. What a row costs is device work,
which the calibration times cleanly over 64 to 4096 rows; a catch-up measured in a step carries
what that step adds (the wait for work queued before it, the host's loads), a fixed cost. Taken
into the slope, the small catch-ups after autoregressive runs (96-384 rows, fixed cost
dominated) made slopes of several us per row from pairs a few hundred rows apart: on the H200
in session 38 the fit put 8192 rows at 29 ms by the sweep's batch 128 (a fresh engine's
calibration and trace: 9.4 ms), and batches 128 and 256 decoded autoregressively on it.
"""

from __future__ import annotations

from collections import deque
from statistics import median

CATCH_UP_WINDOW = 8  # measured catch-ups the fit uses, with the calibration points
SIZE_RATIO = 1.5  # two points of sizes within this ratio give no slope


class CatchUpCost:
    def __init__(self, window: int = CATCH_UP_WINDOW) -> None:
        self._measured: deque[tuple[int, float]] = deque(maxlen=window)
        self._calibrated: list[tuple[int, float]] = []
        self._fit: tuple[float, float] | None = None  # (fixed seconds, seconds per row)

    def calibrate(self, points: list[tuple[int, float]]) -> None:
        """Start-up measurements (rows, seconds); they stay in the fit."""
        self._calibrated = [(rows, s) for rows, s in points if rows > 0]
        self._fit = None

    def observe(self, rows: int, seconds: float) -> None:
        """A catch-up over ``rows`` rows took ``seconds``."""
        if rows > 0:
            self._measured.append((rows, max(seconds, 0.0)))
            self._fit = None

    def seconds(self, rows: int) -> float:
        """Predicted seconds for ``rows`` rows (0 while nothing was measured)."""
        if rows <= 0:
            return 0.0
        if self._fit is None:
            self._fit = self._refit()
        fixed, per_row = self._fit
        return fixed + per_row * rows

    def row_seconds(self, rows: int) -> float:
        """What ``rows`` more rows add to a catch-up paid anyway: the part per row alone."""
        if rows <= 0:
            return 0.0
        if self._fit is None:
            self._fit = self._refit()
        return self._fit[1] * rows

    def _refit(self) -> tuple[float, float]:
        points = [*self._calibrated, *self._measured]
        if not points:
            return 0.0, 0.0
        slopes = _slopes(self._calibrated) or _slopes(points)
        if not slopes:  # one size: proportional, at the lower median cost per row
            per_row = sorted(s / r for r, s in points)
            return 0.0, per_row[(len(per_row) - 1) // 2]
        slope = max(median(slopes), 0.0)
        fixed = max(median(s - slope * r for r, s in points), 0.0)
        return fixed, slope


def _slopes(points: list[tuple[int, float]]) -> list[float]:
    """Seconds per row between every two points of different sizes (Theil-Sen's pairs)."""
    return [
        (s2 - s1) / (r2 - r1)
        for i, (r1, s1) in enumerate(points)
        for r2, s2 in points[i + 1 :]
        if max(r1, r2) >= SIZE_RATIO * min(r1, r2)
    ]
