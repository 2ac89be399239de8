"""What a closed batch costs to finish under drafting: its sequences finish at different steps.

Autoregressive decoding gives every sequence one token per step, so a batch of ``b`` sequences
with ``L`` tokens left each finishes in ``L`` steps of batch ``b``. Drafting gives each sequence
its own yield: an easy prompt accepts five tokens a step, a hard one two. The batch finishes
when its hardest sequence does, and its last steps carry few sequences at nearly the full fixed
cost of a step. On the H200 with the ``gpu`` preset, a batch of 64 drafting with a chain spent
~95 of its 195 ms in the steps after its first sequence finished, and the steady cost per token
(a third below autoregressive decoding's) turned into a 0.8x slowdown
(``bench/results/h200-2026-12-01-session9-trace-b64.txt``).

So the time a closed batch needs under drafting is computed from the spread of yields over
sequences (``YieldSpread``): each finished sequence's tokens per drafting step over the mean
of the batches it was in (its *relative yield* ``r``; 1 for an average prompt). A sequence of
relative yield ``r`` needs ``n = L / (y * r)`` steps, ``y`` the arm's mean yield. Over the
sorted needs ``n_1 <= ... <= n_m`` of the ``m`` samples, between ``n_j`` and ``n_{j+1}`` a
share ``j / m`` of the batch has finished: ``b (1 - j/m)`` sequences are expected alive, and some
sequence is alive with probability ``1 - (j/m)^b`` (``b`` independent draws). The batch costs

    sum_j (n_{j+1} - n_j) * (1 - (j/m)^b) * step(b (1 - j/m) / (1 - (j/m)^b))

seconds: ``step(a)`` is the arm's step time at ``a`` sequences, evaluated at the mean alive
count of the batches still running. With one sample (or all equal) it is ``L / y`` steps of
batch ``b``, the steady cost; for ``b = 1`` it is the mean of the single sequence's steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

SPREAD_WINDOW = 256  # finished sequences whose relative yields are kept
MIN_SPREAD = 16  # samples before the spread is used (until then a fixed drain charge is)
QUANTILES = 16  # points the spread is summarised by (the cost is computed per point)
MIN_DRAFT_STEPS = 4  # drafting steps a finished sequence needs for its yield to count
PRIOR_STEPS = 2.0  # pseudo-steps of the mean yield each sample is shrunk toward


class YieldSpread:
    """Relative yields of the last ``SPREAD_WINDOW`` finished sequences."""

    def __init__(self, window: int = SPREAD_WINDOW, min_steps: int = MIN_DRAFT_STEPS) -> None:
        self.min_steps = min_steps
        self._samples: deque[float] = deque(maxlen=window)
        self._quantiles: list[float] | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, tokens: float, expected: float, steps: int) -> None:
        """A finished sequence produced ``tokens`` in ``steps`` drafting steps, in which the
        batches' mean tokens per sequence summed to ``expected``."""
        if steps < self.min_steps or expected <= 0:
            return
        prior = PRIOR_STEPS * expected / steps
        self._samples.append((tokens + prior) / (expected + prior))
        self._quantiles = None

    @property
    def ready(self) -> bool:
        return len(self._samples) >= MIN_SPREAD

    def quantiles(self) -> list[float]:
        """``QUANTILES`` relative yields at the midpoints of equal shares, ascending."""
        if self._quantiles is None:
            ordered = sorted(self._samples)
            m = len(ordered)
            self._quantiles = [ordered[min(int((i + 0.5) * m / QUANTILES), m - 1)] for i in range(QUANTILES)]
        return self._quantiles


def closed_batch_seconds(
    step_at: Callable[[float], float], batch: int, steps: float, relative_yields: list[float]
) -> float:
    """Seconds until a closed batch of ``batch`` sequences has finished, each sequence needing
    ``steps`` steps at the mean yield and ``steps / r`` at its relative yield ``r`` (one draw
    from ``relative_yields``); ``step_at(a)``: seconds of a step over ``a`` sequences."""
    needs = sorted(steps / max(r, 1e-3) for r in relative_yields)  # steps per sequence, ascending
    m = len(needs)
    total = previous = 0.0
    for j, need in enumerate(needs):
        done = j / m  # share of the batch finished before ``need``
        any_alive = 1.0 - done**batch
        total += (need - previous) * any_alive * step_at(batch * (1.0 - done) / any_alive)
        previous = need
    return total


def relative_yields(per_sequence: list[tuple[int, int]]) -> list[float]:
    """The spread of finished sequences given as (tokens, drafting steps) each, every sequence
    against the mean of them all (an offline run, ``mtpserve eval``): ``QUANTILES`` points, or
    none without a drafting step. Every sequence that drafted counts, however short (the
    shrinkage toward the mean weighs its few steps), since an offline run has few sequences."""
    drafted = [(tokens, steps) for tokens, steps in per_sequence if steps > 0]
    total_steps = sum(steps for _, steps in drafted)
    if not total_steps:
        return []
    mean = sum(tokens for tokens, _ in drafted) / total_steps
    spread = YieldSpread(window=len(drafted), min_steps=1)
    for tokens, steps in drafted:
        spread.observe(tokens, steps * mean, steps)
    return spread.quantiles() if len(spread) else []
