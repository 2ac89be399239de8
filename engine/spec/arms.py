"""Measured choice among captured draft budgets ("arms"): the graphed path's adaptive speculation.

On a GPU the decode step is a CUDA-graph replay whose cost no model of eager forwards predicts
well, while a replay's cost hardly varies: measuring is cheap and exact. So for each batch
bucket (powers of two) the engine's captured budgets — no speculation, a chain, the full tree —
are each run for a few steady steps, their cost per emitted token is kept (an EWMA of the step
time per bucket; the tokens per sequence a budget yields pooled over buckets, since one bucket's
few steps measure a yield poorly), and the cheapest per token is used. Now and then another arm
is run for a short while, the least recently measured first, so the choice follows changes in
acceptance (traffic) and load.

A bucket whose arms are not all measured yet (a batch crossing into a new power of two, the
batch shrinking as requests finish) uses the best arm of the nearest measured bucket, and
measures its own arms at the exploration cadence: a transient bucket never pays for a full
round of exploration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.drafter import TreeBudget

MIN_MEASURED = 3  # steady steps of an arm before its bucket cost counts
RUN = 3  # steps per exploration run: after AR steps the first one catches the MTP modules up


@dataclass
class StepCost:
    """EWMAs of one kind of decode step in one batch bucket: seconds, sequences and emitted
    tokens per step.

    A step counts at most twice the fastest one seen: a stall (a graph's first replay uploads
    it, a garbage collection, a page fault) is not what the choice costs, and one such step
    used to swing the decision for hundreds of steps.
    """

    seconds: float
    rows: float
    tokens: float
    count: int
    fastest: float = float("inf")

    def add(self, seconds: float, rows: int, tokens: int) -> None:
        self.fastest = min(self.fastest, seconds)
        seconds = min(seconds, 2 * self.fastest)
        self.seconds = min(self.seconds, 2 * self.fastest)
        rate = max(0.2, 1 / (self.count + 1))
        self.seconds += (seconds - self.seconds) * rate
        self.rows += (rows - self.rows) * rate
        self.tokens += (tokens - self.tokens) * rate
        self.count += 1


@dataclass
class _Bucket:
    costs: dict[TreeBudget, StepCost] = field(default_factory=dict)
    last_run: dict[TreeBudget, int] = field(default_factory=dict)  # arm -> step it last ran


class MeasuredArms:
    """Per batch bucket, the arm with the lowest measured seconds per emitted token."""

    def __init__(self, explore_every: int = 16) -> None:
        self.explore_every = explore_every
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        # Tokens per sequence per step of each speculating arm, pooled over buckets:
        # (sampled, arm) -> (EWMA, steps).
        self._yield: dict[tuple[bool, TreeBudget], tuple[float, int]] = {}
        self._calls = 0
        self._since_explore = 0
        self._run: tuple[TreeBudget, int] | None = None  # arm being explored, steps left

    # ------------------------------------------------------------------ measurements
    def observe(self, batch_size: int, sampled: bool, arm: TreeBudget, seconds: float, tokens: int) -> None:
        """One steady decode step of ``arm``: its wall time and the tokens it produced before
        max_tokens / stop truncation."""
        if tokens <= 0:
            return
        bucket = self._buckets.setdefault((batch_size.bit_length(), sampled), _Bucket())
        cost = bucket.costs.get(arm)
        if cost is None:
            bucket.costs[arm] = StepCost(seconds, float(batch_size), float(tokens), 1, seconds)
        else:
            cost.add(seconds, batch_size, tokens)
        if arm.speculates:  # a long memory: ~50 steps
            mean, n = self._yield.get((sampled, arm), (0.0, 0))
            mean += (tokens / batch_size - mean) * max(0.02, 1 / (n + 1))
            self._yield[(sampled, arm)] = (mean, n + 1)

    def per_token(self, bucket: int, sampled: bool, arm: TreeBudget) -> float | None:
        """Measured seconds per emitted token of ``arm`` in ``bucket`` (None: not measured)."""
        cost = self._buckets.get((bucket, sampled), _Bucket()).costs.get(arm)
        if cost is None or cost.count < MIN_MEASURED:
            return None
        if not arm.speculates:
            return cost.seconds / cost.tokens
        pooled = self._yield.get((sampled, arm), (cost.tokens / cost.rows, 0))[0]
        return cost.seconds / (cost.rows * pooled)

    def best(self, bucket: int, sampled: bool, arms: list[TreeBudget]) -> TreeBudget | None:
        """The cheapest arm per token once every arm of the bucket is measured, else None."""
        costs = [(self.per_token(bucket, sampled, arm), i) for i, arm in enumerate(arms)]
        if any(c is None for c, _ in costs):
            return None
        return arms[min(costs)[1]]  # type: ignore[type-var]

    # ------------------------------------------------------------------ choice
    def choose(self, batch_size: int, sampled: bool, arms: list[TreeBudget]) -> TreeBudget:
        """The arm for this step (``arms`` in a fixed order, no speculation first)."""
        self._calls += 1
        target = batch_size.bit_length()
        bucket = self._buckets.setdefault((target, sampled), _Bucket())
        if self._run is not None and self._run[0] in arms:  # finish an exploring run
            arm, left = self._run
            self._run = (arm, left - 1) if left > 1 else None
            return self._ran(bucket, arm)
        best = self.best(target, sampled, arms)
        fallback = best or self._nearest_best(target, sampled, arms)
        self._since_explore += 1
        unmeasured = [a for a in arms if self.per_token(target, sampled, a) is None]
        if fallback is None:  # nothing measured anywhere: measure every arm in turn
            due = True
        else:
            due = self._since_explore >= self.explore_every * (1 if best is None else len(arms))
        if due:
            others = unmeasured or [a for a in arms if a != fallback]
            if others:
                arm = min(others, key=lambda a: bucket.last_run.get(a, -1))
                self._since_explore = 0
                self._run = (arm, RUN - 1)
                return self._ran(bucket, arm)
        assert fallback is not None
        return self._ran(bucket, fallback)

    def _ran(self, bucket: _Bucket, arm: TreeBudget) -> TreeBudget:
        bucket.last_run[arm] = self._calls
        return arm

    def _nearest_best(self, target: int, sampled: bool, arms: list[TreeBudget]) -> TreeBudget | None:
        """The best arm of the nearest bucket with every arm measured (ties: the larger batch)."""
        measured = [b for (b, s) in self._buckets if s == sampled and self.best(b, s, arms) is not None]
        if not measured:
            return None
        nearest = min(measured, key=lambda b: (abs(b - target), -b))
        return self.best(nearest, sampled, arms)
