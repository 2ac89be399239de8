"""What adaptive speculation measures of its arms (``engine.spec.arms``): step costs per batch
bucket, yields, catch-ups, filling steps.

Each kind of decode step ("arm": no speculation, a chain, a tree) has, per batch-size bucket
(powers of two) and kind of batch (greedy or sampled), an EWMA of its step time, sequences and
emitted tokens (``StepCost``), or a step time calibrated at start-up (``seed_cost``). A drafting
arm's tokens per sequence per step are pooled over buckets, each step weighted by its sequences,
and averaged with the simulator's prediction for its shape (``arm_yield``). A bucket where an
arm has not run extrapolates its step time from the two nearest buckets where it has
(``estimate``). Catch-ups of the MTP modules (``CatchUpCost``), the spread of finished
sequences' yields (``YieldSpread``) and whole filling steps (``observe_filling``) are kept apart
from the steady costs, which they would distort.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.catch_up_cost import CatchUpCost
from engine.spec.drafter import TreeBudget
from engine.spec.drain import YieldSpread

YIELD_RATE = 0.02  # EWMA weight of one sequence-step in the pooled yield
MIN_MEASURED = 3  # steady steps of an arm before its bucket cost counts
FLOOR_RISE = 0.05  # EWMA weight of a dearer step in an arm's floor cost per token
YIELD_PRIOR_SEQ_STEPS = 16.0  # sequence-steps of measurement the simulator's yield counts as


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
    # Seconds per token when the host is not disturbed: follows a cheaper step at once, a
    # dearer one slowly (what a switch away from this arm is weighed against).
    floor: float = float("inf")
    served: int = 0  # steps of it served in the bucket (a calibrated cost counts none)
    calibrated: float | None = None  # the start-up calibration's step seconds, if seeded

    def add(self, seconds: float, rows: int, tokens: int) -> None:
        self.served += 1
        per_token = seconds / max(tokens, 1)
        if per_token < self.floor:
            self.floor = per_token
        else:
            self.floor += (per_token - self.floor) * FLOOR_RISE
        self.fastest = min(self.fastest, seconds)
        seconds = min(seconds, 2 * self.fastest)
        self.seconds = min(self.seconds, 2 * self.fastest)
        rate = max(0.2, 1 / (self.count + 1))
        self.seconds += (seconds - self.seconds) * rate
        self.rows += (rows - self.rows) * rate
        self.tokens += (tokens - self.tokens) * rate
        self.count += 1


@dataclass
class Bucket:
    """One batch bucket's steps and each arm's cost in it."""

    # Steps chosen in this bucket: exploration waits count the bucket's own steps, so a bucket
    # the batch only passes through (growing through its prefill, shrinking as requests end)
    # does not find every arm overdue each time it comes back.
    steps: int = 0
    costs: dict[TreeBudget, StepCost] = field(default_factory=dict)
    last_run: dict[TreeBudget, int] = field(default_factory=dict)  # arm -> bucket step it last ran


def add_step(bucket: Bucket, arm: TreeBudget, seconds: float, rows: int, tokens: int) -> None:
    """One served step of ``arm`` into ``bucket``'s cost of it (the first one starts it)."""
    cost = bucket.costs.get(arm)
    if cost is None:
        bucket.costs[arm] = StepCost(seconds, float(rows), float(tokens), 1, seconds, seconds / tokens, served=1)
    else:
        cost.add(seconds, rows, tokens)


@dataclass
class Estimate:
    """An arm's cost at a bucket (``ArmMeasurements.estimate``)."""

    step: float  # seconds per step at this bucket
    per_token: float  # seconds per emitted token
    measured: bool  # measured in this bucket (else extrapolated from another)
    source: int  # the nearest bucket it was measured in


class ArmMeasurements:
    """The measurements ``MeasuredArms`` chooses by."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, bool], Bucket] = {}
        # Tokens per sequence per step of each speculating arm, pooled over buckets:
        # (sampled, arm) -> (EWMA, sequence-steps seen).
        self._yield: dict[tuple[bool, TreeBudget], tuple[float, int]] = {}
        # What an MTP catch-up costs (the same work for greedy and sampled batches).
        self.catch_up = CatchUpCost()
        # Tokens per sequence per step of each speculating arm over all its steps, (tokens,
        # sequence-steps): the reference a sequence's relative yield is taken against.
        self._lifetime: dict[tuple[bool, TreeBudget], tuple[float, int]] = {}
        # How yields spread over sequences: what a closed batch's drain costs (engine.spec.drain).
        self.spread = YieldSpread()
        # The simulator's tokens per sequence per step of each drafting arm (sampled, arm).
        # (sampled, arm) -> (predicted tokens per step, the sequence-steps it counts as)
        self._predicted: dict[tuple[bool, TreeBudget], tuple[float, float]] = {}
        # Whole engine steps that prefilled and decoded, per decode batch bucket and arm
        # (``observe_filling``): apart from the steady costs, which they would distort.
        self._fill: dict[tuple[int, bool], Bucket] = {}
        # Seconds of decode steps served (steady and filling): what a run to learn a thin
        # yield may spend (``MeasuredArms._relearn``).
        self._served_s = 0.0

    def _bucket(self, bucket: int, sampled: bool) -> Bucket:
        found = self._buckets.get((bucket, sampled))  # (no throwaway Bucket at every step)
        if found is None:
            found = self._buckets[(bucket, sampled)] = Bucket()
        return found

    def observe(self, batch_size: int, sampled: bool, arm: TreeBudget, seconds: float, tokens: int) -> None:
        """One steady decode step of ``arm``: its wall time and the tokens it produced before
        max_tokens / stop truncation."""
        if tokens <= 0:
            return
        self._served_s += seconds
        add_step(self._bucket(batch_size.bit_length(), sampled), arm, seconds, batch_size, tokens)
        if arm.speculates:
            self._observe_yield(batch_size, sampled, arm, tokens)
            total, seq_steps = self._lifetime.get((sampled, arm), (0.0, 0))
            self._lifetime[(sampled, arm)] = (total + tokens, seq_steps + batch_size)

    def seed_cost(self, batch_size: int, sampled: bool, arm: TreeBudget, seconds: float) -> None:
        """A step time calibrated at start-up (``engine.spec.arm_calibration``): ``arm``'s cost in
        this batch's bucket before any step of it ran there, counted as ``MIN_MEASURED`` steps
        (the steps served refine it). Its yield is left to the acceptance statistics: an arm
        with a seeded cost but no measured yield is run once soon (``choose``)."""
        if not seconds > 0.0:
            raise ValueError(f"a calibrated step time is positive, got {seconds}")
        self._bucket(batch_size.bit_length(), sampled).costs[arm] = StepCost(
            seconds, float(batch_size), float(batch_size), MIN_MEASURED, seconds, seconds / batch_size,
            calibrated=seconds,
        )

    def observe_filling(self, batch_size: int, sampled: bool, arm: TreeBudget, seconds: float, tokens: int) -> None:
        """One whole engine step that prefilled requests joining the batch and decoded its
        ``batch_size`` sequences with ``arm``: its wall time from the prefill's start to the
        decode's last read (the same prefill work under either arm, and for a drafting arm
        the newcomers' batch rows loaded afresh) and the tokens the decode produced."""
        if tokens > 0:
            self._served_s += seconds
            bucket = self._fill.setdefault((batch_size.bit_length(), sampled), Bucket())
            add_step(bucket, arm, seconds, batch_size, tokens)

    def observe_counterfactual_yield(self, batch_size: int, sampled: bool, arm: TreeBudget, tokens: int) -> None:
        """The ``tokens`` drafting ``arm`` would have produced in a step another arm ran over
        the same ``batch_size`` sequences (a tree step's accepted path through rank-0 children
        is what the chain would have accepted: ``StepResults.chain_tokens``). Arms compared on
        the same prompts: at batch 1 every request is another prompt, and a chain run on an
        easy one once outranked a tree measured on a hard one for a whole request."""
        if tokens > 0 and arm.speculates:
            self._observe_yield(batch_size, sampled, arm, tokens)

    def _observe_yield(self, batch_size: int, sampled: bool, arm: TreeBudget, tokens: int) -> None:
        # A memory of ~50 sequence-steps, each step weighted by its sequences: a batch of 16 is
        # 16 samples of the yield, and prompts differ (a batch of one easy prompt must not set
        # the yield a batch of 16 then relies on).
        mean, n = self._yield.get((sampled, arm), (0.0, 0))
        weight = max(1 - (1 - YIELD_RATE) ** batch_size, batch_size / (n + batch_size))
        mean += (tokens / batch_size - mean) * weight
        self._yield[(sampled, arm)] = (mean, n + batch_size)

    def set_predicted_yield(
        self, sampled: bool, arm: TreeBudget, tokens_per_step: float, weight: float = YIELD_PRIOR_SEQ_STEPS
    ) -> None:
        """The simulator's expected tokens per sequence per step of drafting ``arm`` (its
        shape's expected accepted length plus the bonus token, under live statistics), counting
        as ``weight`` sequence-steps of measurement (less for a prior than for live statistics)."""
        if not tokens_per_step >= 1.0:
            raise ValueError(f"a predicted yield is at least 1 token per step, got {tokens_per_step}")
        if not weight > 0.0:
            raise ValueError(f"a prediction's weight must be positive, got {weight}")
        self._predicted[(sampled, arm)] = (tokens_per_step, weight)

    def predicted_yield(self, sampled: bool, arm: TreeBudget) -> float | None:
        """The prediction ``set_predicted_yield`` last gave ``arm`` (None: none yet)."""
        predicted = self._predicted.get((sampled, arm))
        return None if predicted is None else predicted[0]

    def arm_yield(self, sampled: bool, arm: TreeBudget) -> float | None:
        """Tokens per sequence per step ``arm`` is expected to yield: the simulator's prediction
        averaged with the measured yield (an EWMA over ~``1 / YIELD_RATE`` sequence-steps, so it
        counts as at most that many), the prediction weighing what it was set with
        (``YIELD_PRIOR_SEQ_STEPS`` for live statistics); either alone where the other is
        missing (None: neither)."""
        measured = self._yield.get((sampled, arm))
        predicted = self._predicted.get((sampled, arm))
        if predicted is None:
            return None if measured is None else measured[0]
        value, prior = predicted
        if measured is None:
            return value
        mean, seen = measured
        weight = min(float(seen), 1.0 / YIELD_RATE)
        return (mean * weight + value * prior) / (weight + prior)

    def mean_yield(self, sampled: bool, arm: TreeBudget) -> float:
        """Tokens per sequence per step ``arm`` has produced over all its steps (1.0 before any):
        the engine sums it over each sequence's drafting steps, what ``observe_finished`` takes
        as ``expected``."""
        total, seq_steps = self._lifetime.get((sampled, arm), (0.0, 0))
        return total / seq_steps if seq_steps else 1.0

    def observe_finished(self, tokens: float, expected: float, steps: int) -> None:
        """A finished sequence's ``tokens`` over ``steps`` drafting steps, against the
        ``expected`` tokens of an average sequence in them (``engine.spec.drain``)."""
        self.spread.observe(tokens, expected, steps)

    def observe_catch_up(
        self, batch_size: int, sampled: bool, arm: TreeBudget, seconds: float, lag_rows: int,
        timed_alone: bool = False,
    ) -> None:
        """A first step of ``arm`` that caught the MTP modules up over ``lag_rows`` rows (the
        prompts of new requests, the tokens of autoregressive steps). ``seconds``: the catch-up
        alone (``timed_alone``, as the graphed path times it) or the whole step, whose time
        beyond a steady step of ``arm`` is then the catch-up. Nothing is recorded while ``arm``
        has no steady step measured anywhere: the first steps also compile kernels and upload
        graphs (one such catch-up, taken at face value, once kept a GPU from drafting at all)."""
        est = self.estimate(batch_size.bit_length(), sampled, arm)
        if est is None or lag_rows <= 0:
            return
        self.catch_up.observe(lag_rows, seconds if timed_alone else max(seconds - est.step, 0.0))

    def catch_up_seconds(self, lag_rows: int) -> float:
        """What catching the MTP modules up over ``lag_rows`` rows costs (0 until measured or
        calibrated; ``engine.spec.catch_up_cost``)."""
        return self.catch_up.seconds(lag_rows)

    def cost_table(self) -> list[tuple[bool, TreeBudget, StepCost]]:
        """Every arm's measured step cost per batch-size bucket (at least ``MIN_MEASURED``
        steady steps): (sampled, arm, cost), smallest buckets first."""
        return [
            (sampled, arm, cost)
            for (_, sampled), bucket in sorted(self._buckets.items())
            for arm, cost in bucket.costs.items()
            if cost.count >= MIN_MEASURED
        ]

    def bucket_costs(self, batch_size: int, sampled: bool) -> dict[TreeBudget, StepCost]:
        """The costs recorded in ``batch_size``'s bucket, by arm (diagnosis tools)."""
        return dict(self._buckets.get((batch_size.bit_length(), sampled), Bucket()).costs)

    def fill_cost_table(self) -> list[tuple[bool, TreeBudget, StepCost]]:
        """Every arm's measured filling step per decode batch bucket (``observe_filling``):
        (sampled, arm, cost), smallest buckets first."""
        return [
            (sampled, arm, cost)
            for (_, sampled), bucket in sorted(self._fill.items())
            for arm, cost in bucket.costs.items()
        ]

    def per_token(self, bucket: int, sampled: bool, arm: TreeBudget) -> float | None:
        """Measured seconds per emitted token of ``arm`` in ``bucket`` (None: not measured)."""
        cost = self._buckets.get((bucket, sampled), Bucket(0)).costs.get(arm)
        if cost is None or cost.count < MIN_MEASURED:
            return None
        return cost.seconds / (cost.rows * self.tokens_per_seq(sampled, arm, cost))

    def tokens_per_seq(self, sampled: bool, arm: TreeBudget, cost: StepCost) -> float:
        """Tokens per sequence per step the choice counts on for ``arm`` with bucket ``cost``: a
        drafting arm's yield (``arm_yield``, pooled over buckets) where known, else the bucket's
        measured tokens (one per sequence for a step time only calibrated)."""
        expected = self.arm_yield(sampled, arm) if arm.speculates else None
        return cost.tokens / cost.rows if expected is None else expected

    def estimate(self, bucket: int, sampled: bool, arm: TreeBudget) -> Estimate | None:
        """``arm``'s cost at ``bucket``: measured there, else extrapolated from the buckets where
        it was measured (None: measured nowhere). With two or more, the step time is the line
        through the two nearest (time = fixed + per sequence x batch, never decreasing); with
        one, that bucket's step time as it is."""
        own = self._buckets.get((bucket, sampled))
        cost = None if own is None else own.costs.get(arm)
        if cost is not None and cost.count >= MIN_MEASURED:  # measured (or calibrated) here
            per_token = cost.seconds / (cost.rows * self.tokens_per_seq(sampled, arm, cost))
            return Estimate(cost.seconds, per_token, True, bucket)
        found = sorted(
            ((abs(b - bucket), -b, b) for (b, s), bk in self._buckets.items()
             if s == sampled and (c := bk.costs.get(arm)) is not None and c.count >= MIN_MEASURED),
        )  # fmt: skip
        if not found:
            return None
        near = [self._buckets[(b, sampled)] for *_, b in found[:2]]
        cost = near[0].costs[arm]
        rows = float(1 << (bucket - 1))
        step = cost.seconds
        if len(near) == 2:
            other = near[1].costs[arm]
            if other.rows != cost.rows:
                slope = max((other.seconds - cost.seconds) / (other.rows - cost.rows), 0.0)
                # Never below the nearest bucket's time (larger batch) or its time scaled by
                # the batch (smaller batch: a line with a negative fixed part).
                floor = cost.seconds * min(rows / cost.rows, 1.0)
                step = max(cost.seconds + slope * (rows - cost.rows), floor)
        per_token = step / (rows * self.tokens_per_seq(sampled, arm, cost))
        return Estimate(step, per_token, False, found[0][2])
