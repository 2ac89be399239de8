"""Learning-rate schedule and phase budgets.

A phase runs either for a number of steps or for a wall-clock time (the time budget of the run).
Its *progress* in [0, 1] is the larger of ``step / max_steps`` and ``elapsed / time_s``, so a
budgeted run ends with the learning rate at its minimum exactly when time is up, whatever the
throughput, the compile time or the evaluation pauses turned out to be. Warm-up is counted in
steps (the first steps may be slow: CUDA start, compilation) and multiplies the cosine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PhasePlan:
    name: str  # "joint" or "distill"
    peak_lr: float
    min_lr_ratio: float
    warmup_steps: int
    max_steps: int | None = None
    time_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_steps is None and self.time_s is None:
            raise ValueError(f"phase {self.name}: give max_steps or time_s")

    def progress(self, step: int, elapsed_s: float) -> float:
        fractions = []
        if self.max_steps is not None:
            fractions.append(step / max(self.max_steps, 1))
        if self.time_s is not None:
            fractions.append(elapsed_s / self.time_s if self.time_s > 0 else 1.0)
        return max(fractions)

    def lr(self, step: int, elapsed_s: float) -> float:
        """Linear warm-up over ``warmup_steps`` times a cosine from peak to ``min_lr_ratio``·peak."""
        progress = min(self.progress(step, elapsed_s), 1.0)
        warm = min(1.0, (step + 1) / max(self.warmup_steps, 1))
        cosine = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )
        return self.peak_lr * warm * cosine
