"""Measured choice among captured draft budgets ("arms"): the graphed path's adaptive speculation.

On a GPU the decode step is a CUDA-graph replay whose cost no model of eager forwards predicts
well, while a replay's cost hardly varies: measuring is cheap and exact. So for each batch
bucket (powers of two) the engine's captured budgets — no speculation, a chain, the full tree —
have a cost per emitted token: an EWMA of the step time in the bucket over the tokens per
sequence the budget yields (pooled over buckets, each step weighted by its sequences: one
bucket's few steps measure a yield poorly, one prompt's steps stand for one prompt).
The cheapest arm is used. (What is measured, and how it is kept: ``engine.spec.arm_measurements``;
this module makes the choice.)

On a GPU every arm's step time at every batch bucket is calibrated at start-up
(``engine.spec.arm_calibration``, ``seed_cost``): the latency model of the verify step as a
function of its tokens, counted as a few measured steps that the steps served then refine. So
no exploring run is needed to learn what a step costs at a batch size, only one per drafting
arm to learn its yield (below), where its catch-up fits the requests' horizon.

A drafting arm's yield is the simulator's, calibrated by measurement: the engine hands in the
expected tokens per step of each arm's shape under the live acceptance statistics
(``set_predicted_yield``: ``engine.simulator.expected_length`` of the optimiser's tree for the
budget, or of the chain), and the arm's own measured yield is its evidence: the two are
averaged with the prediction counting as ``YIELD_PRIOR_SEQ_STEPS`` sequence-steps. So an arm
run for a few steps (the tree explored at batch 1 on one prompt) is valued by the model the
optimiser plans with, not by those steps alone, and an arm measured over many sequence-steps by
what it delivered. The chain's measured yield also counts what it would have yielded in the
tree's steps (``observe_counterfactual_yield``: the accepted path's leading rank-0 nodes), so
the two are compared on the same prompts.

A bucket where an arm has not run yet extrapolates its step time from the buckets where it has:
the line through the two nearest (a step costs a fixed part plus a part per sequence; drafting
arms have the steeper line, verify work growing with the batch), or the one bucket's time as it
is. So a batch that grows past the size where drafting stops paying switches to
autoregressive decoding without re-measuring every draft budget at every size.

The other arms are re-run now and then, each at a cadence set by what a run of it costs: a run
costs at most ``EXPLORE_SHARE`` of the time the chosen arm runs between two runs
(``EXPLORE_SHARE_NEW`` while the arm has not run in this bucket), counted in the bucket's own
steps. An arm only extrapolated to this bucket is measured within ``explore_every`` steps when
it may win here (``_worth_measuring``) and would pay its catch-up.

A drafting step after autoregressive steps (or for requests just admitted) first catches the MTP
modules up over every row they are behind. Its cost (a fixed part plus a part per row,
``engine.spec.catch_up_cost``: calibrated at start-up, refitted to every catch-up measured) is
counted, for the rows behind now, in the cost of an exploring run and of drafting (and of a run
of autoregressive steps while drafting: coming back needs one): a drafting arm behind by some
rows is chosen only if what it saves over the tokens the batch may still generate (its
requests' max_tokens left, at most ``MAX_HORIZON_TOKENS`` each) exceeds its catch-up and its
drain: drafting spreads the steps at which requests finish. For a closed batch (nothing waiting
or in prefill) whose spread of per-sequence yields is known (``engine.spec.drain``, reported by
the engine as sequences finish) the drain is the expected time until its hardest sequence is
done, at the arm's step costs of the shrinking batch, beyond the steady cost, and it is charged
also while the arm drafts; otherwise ``DRAIN_STEPS`` of its steps. So a
large batch of short requests that decodes autoregressively (where the catch-up of hundreds of
prompts costs many steps) does not pay for probes of drafting that could not pay off, while
long requests, or a small batch behind by a few rows, switch at once. Every run that would
pay a catch-up, also one measuring an arm known only from other batch sizes, must fit that
catch-up within its share of the batch's horizon; and while requests are being prefilled into
the batch (``filling``), nothing switches to drafting over a lag: the batch is about to change
bucket and the newcomers need their own catch-up. Instead the engine asks, as each prefill
chunk of a filling batch ends, whether the batch it becomes would switch to drafting with the
catch-up of all its prompts counted (``drafting_arm``, which decides as ``choose`` would but
records nothing); if so it catches each chunk up in its prefill, and the chunks already
prefilled, nothing left to catch up, may draft while the rest are prefilled.

Whether they do is decided by what filling steps cost, measured apart from the steady steps
(``observe_filling``: the whole engine step, its prefill included, per decode batch bucket and
arm). A filling drafting step costs more than a steady one: the prefill runs first and the
newcomers' rows are loaded from the host. So a filling step drafts only if what its filling step
costs beyond the autoregressive one's buys more than it costs: the tokens it makes beyond one
per sequence, each one the filled batch need not make later at its steady cost per token, plus
the rows an autoregressive step would leave to catch up (``_filling_arm``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.spec.arm_measurements import MIN_MEASURED, ArmMeasurements, Bucket, Estimate
from engine.spec.drafter import TreeBudget
from engine.spec.drain import closed_batch_seconds

RUN = 3  # steps per exploration run: after AR steps the first one catches the MTP modules up
EXPLORE_SHARE = 0.02  # of the chosen arm's time, spent re-running an arm measured in the bucket
EXPLORE_SHARE_NEW = 0.1  # the same for an arm not measured in the bucket yet
EXPLORE_SHARE_SOON = 0.5  # catch-up of a run measuring an arm that may win here, at most
CLOSE = 1.1  # a drafting arm within this factor of the drafting arm chosen is re-run soon
SWITCH_HORIZON = 16  # steps within which a switch to drafting must win back its MTP catch-up
DRAIN_STEPS = 2.0  # drafting steps a switch is charged for its drain while the spread is unknown
MAX_HORIZON_TOKENS = 256  # tokens per sequence it may count on, whatever max_tokens allows
MAX_EXPLORE_INTERVAL = 1024  # bucket steps a catch-up may defer a run to, at most
EXTRAPOLATION_MARGIN = 0.5  # per batch doubling an estimate is extrapolated over, in a switch
HOLD_STEPS = 4  # steps a choice stands for the same bucket and arms before it is made afresh
FILL_REMEASURE = 32  # free filling choices of a bucket between runs of the filling arm not chosen
# Sequence-steps of measured yield below which a drafting arm's yield is still being learnt: it
# is re-run as soon as the time served since its last run pays for the run (``_relearn``).
THIN_YIELD_SEQ_STEPS = 32


@dataclass(frozen=True)
class SwitchWeighing:
    """The terms of the last switch to drafting weighed (``_switch_pays``), for diagnosis:
    it pays when ``saving`` exceeds ``margin * (catch_up + drain)`` (seconds)."""

    arm: TreeBudget
    saving: float
    catch_up: float
    drain: float
    margin: float

    @property
    def pays(self) -> bool:
        return self.saving > self.margin * (self.catch_up + self.drain)


@dataclass(frozen=True)
class FillQuestion:
    """A filling batch's question, whether the batch it becomes drafts (``drafting_arm``), and
    its answer: what a sweep records to tell why a batch size drafted or not."""

    batch_size: int
    sampled: bool
    answer: TreeBudget | None
    weighing: SwitchWeighing | None  # None: nothing weighed (too little known, nothing to catch up)

    def to_dict(self, label: Callable[[TreeBudget], str]) -> dict[str, object]:
        """JSON-ready, ``label`` naming a budget (``engine.spec.adaptive.budget_label``)."""
        w = self.weighing
        return {"batch_size": self.batch_size, "sampled": self.sampled,
                "answer": None if self.answer is None else label(self.answer),
                "arm": None if w is None else label(w.arm),
                **({} if w is None else {"saving_ms": w.saving * 1e3, "catch_up_ms": w.catch_up * 1e3,
                                          "drain_ms": w.drain * 1e3, "margin": w.margin})}  # fmt: skip


class MeasuredArms(ArmMeasurements):
    """Per batch bucket, the arm with the lowest measured (or extrapolated) seconds per token."""

    def __init__(self, explore_every: int = 16) -> None:
        super().__init__()
        self.explore_every = explore_every
        self._run: tuple[TreeBudget, int] | None = None  # arm being explored, steps left
        # The last choice, (bucket, sampled, arms, behind), arm, bucket step until which it
        # stands: its inputs move slowly, and making it costs host time each step.
        self._held: tuple[tuple[int, bool, tuple[TreeBudget, ...], bool], TreeBudget, int] | None = None
        # The drafting arm the filling steps of the fill under way keep (``_filling_arm``).
        self._fill_drafting: TreeBudget | None = None
        # The terms of the last switch weighed on costs (``_switch_pays``; diagnosis tools).
        self.last_weighing: SwitchWeighing | None = None
        # The newest fill questions (``drafting_arm``) and how many were asked in all.
        self.fill_questions: deque[FillQuestion] = deque(maxlen=64)
        self.fill_questions_asked = 0
        # The served-seconds clock's reading (``_served_s``) when each arm last began an
        # exploring run.
        self._explored_at: dict[tuple[bool, TreeBudget], float] = {}

    # ------------------------------------------------------------------ choice
    def choose(
        self, batch_size: int, sampled: bool, arms: list[TreeBudget], lag_rows: int = 0,
        tokens_left: float | None = None, filling: bool = False, closed: bool = False,
        filled_batch: int | None = None,
    ) -> TreeBudget:
        """The arm for this step (``arms`` in a fixed order, no speculation first); ``lag_rows``:
        rows the MTP modules are behind (what a drafting step would first catch up);
        ``tokens_left``: tokens each sequence may still generate, on average (its max_tokens
        left; None: unknown), the horizon within which a switch to drafting must pay;
        ``filling``: requests are being admitted (in prefill) and join the batch within steps;
        ``closed``: nothing joins the batch (none waiting or in prefill, and the caller said so
        or no request arrived for a while: ``LLMEngine.step``), so it only shrinks and a drafting
        arm is charged for its drain (``engine.spec.drain``) whenever the spread of yields
        is known, also while it drafts; ``filled_batch``: the batch size a filling batch is
        headed for (its running and waiting requests, up to the batch limit; default
        ``batch_size``), where the tokens a filling step makes would otherwise be made.

        A filling step drafts only where its measured filling steps say it pays
        (``_filling_arm``): its newcomers' rows are loaded afresh and its prefill runs first, so
        a steady step's cost does not tell (the demo model on an H200, 128-token prefill chunks:
        a tree step filling batch 64 took ~3.2 ms against ~1.5 ms for an autoregressive one,
        and drafting through the fill ran 0.75-0.89x autoregressive decoding)."""
        target = batch_size.bit_length()
        bucket = self._bucket(target, sampled)
        bucket.steps += 1
        if not filling:  # a step without a prefill ends a fill
            self._fill_drafting = None
        if self._run is not None and self._run[0] in arms:  # finish an exploring run
            arm, left = self._run
            self._run = (arm, left - 1) if left > 1 else None
            return self._ran(bucket, arm)
        if filling and lag_rows > 0:
            # A batch still filling: a catch-up now is followed by the newcomers' own, and the
            # batch lands in another bucket, whose costs decide (the H200's batch 256 paid
            # 35 ms to draft at 64 sequences of it, one step before 64 more joined).
            self._held = None
            self._fill_drafting = None
            return self._ran(bucket, arms[0])
        if filling and self._fill_drafting in arms:
            return self._ran(bucket, self._fill_step(target, sampled, self._fill_drafting))
        key = (target, sampled, tuple(arms), lag_rows > 0)
        if not filling and self._held is not None and self._held[0] == key and bucket.steps < self._held[2]:
            return self._ran(bucket, self._held[1])
        estimates, best = self._cheapest(target, sampled, arms)
        if best is None:  # nothing measured anywhere: run every arm in turn
            return self._explore(bucket, sampled, min(arms, key=lambda a: bucket.last_run.get(a, -1)))
        catch_up = self.catch_up_seconds(lag_rows)
        base_cost = self._base_cost(target, sampled, arms[0], estimates[arms[0]], batch_size)
        drains = closed and tokens_left is not None and self.spread.ready

        def pays(arm: TreeBudget) -> bool:
            return self._switch_pays(arm, estimates[arm], base_cost, batch_size, sampled, catch_up,
                                     drains, tokens_left)  # fmt: skip

        chosen = best if pays(best) else arms[0]
        if estimates[chosen] is None:
            # A drafting arm was measured but does not pay here, and no speculation never was at
            # any batch size (CPU engines, no start-up calibration): learn its cost by running it.
            # (Its estimate had been read as if present: a stream of short requests crashed.)
            return self._explore(bucket, sampled, chosen)
        step = estimates[chosen].step  # type: ignore[union-attr]
        chosen_cost = estimates[chosen].per_token  # type: ignore[union-attr]
        if filling:
            # Not a steady step: no steady arm is explored in it (its time is the fill's).
            after = chosen_cost
            if filled_batch is not None and filled_batch.bit_length() != target:
                later, cheapest = self._cheapest(filled_batch.bit_length(), sampled, arms)
                if cheapest is not None:
                    after = later[cheapest].per_token  # type: ignore[union-attr]
            return self._ran(bucket, self._filling_arm(target, sampled, arms[0], chosen, batch_size, after))
        overdue = []
        for arm, est in estimates.items():
            if arm == chosen:
                continue
            share: float | None = None  # of the horizon a run's catch-up may take
            if est is None:  # never measured at any batch size: learn it now
                interval = 1.0
            elif arm.speculates and (sampled, arm) not in self._yield:
                # Its step time calibrated at start-up, its yield never measured: learn it soon,
                # if a run's catch-up fits the horizon (below; the yield found at one batch size
                # serves all).
                interval, share = 1.0, EXPLORE_SHARE_NEW
            elif arm.speculates and self._relearn(sampled, arm, chosen, est, chosen_cost, catch_up):
                # Its yield measured on a few sequence-steps only, while no drafting arm is
                # chosen, and the time served since its last run pays for another at that share,
                # whatever the horizon: the yield serves every later request. (The demo model on
                # an H200: batch-1 requests of 64 tokens one at a time, where a 2 ms run never
                # fit 0.1 x 21 ms; the tree's yield stood at 2.4 tokens from three steps of the
                # warm-up, and the engine never drafted again, where batch 64 measured 6.2.)
                interval = 1.0
            elif (not est.measured
                    and self._worth_measuring(target, sampled, arm, est, arms[0], chosen_cost)
                    and (est.source > target or pays(arm))):
                # Soon; extrapolated from smaller batches (an optimistic line), only if it
                # would pay its catch-up. From larger ones its step is cheaper here than the
                # estimate, and so is its catch-up.
                interval, share = float(self.explore_every), EXPLORE_SHARE_SOON
            else:  # what a run costs, in steps of the chosen arm, at the share it may take
                share = EXPLORE_SHARE if est.measured else EXPLORE_SHARE_NEW
                steady = max(float(self.explore_every), RUN * est.step / (share * max(step, 1e-9)))
                if arm.speculates and chosen.speculates and est.per_token <= CLOSE * chosen_cost:
                    # Two drafting arms this close (the H200's chain and tree at batch 1: 0.42 ms
                    # per token each) are told apart by a few noisy steps, and a run of the other
                    # costs at most 10% more and no catch-up: re-measure it soon.
                    steady = float(self.explore_every)
                # A run of a drafting arm first catches up; a run of autoregressive steps
                # while drafting leaves a catch-up to come back (the device step takes the
                # MTP state of a drafting step only), whose fixed part alone is ~10 steps.
                if arm.speculates:
                    switch = catch_up
                else:
                    switch = self.catch_up_seconds(RUN * batch_size) if chosen.speculates else 0.0
                extra = switch / (share * max(step, 1e-9))
                # The catch-up defers a run by at most MAX_EXPLORE_INTERVAL steps: an estimate
                # of it that forbade re-measuring (one timed during a stall) would stand forever.
                interval = max(steady, min(steady + extra, float(MAX_EXPLORE_INTERVAL)))
            # Nor may a run's catch-up exceed that share of the time the batch may still decode
            # (a catch-up over hundreds of prompts of short requests would; so would one near a
            # batch's end: the H200's batch 256 paid 73 ms to measure a chain with 10 of 64
            # tokens to go). A run to learn an unknown yield also counts what its steps cost
            # beyond the chosen arm's: the H200's batch 256 ran three tree steps (26 + 14 + 14
            # ms against 6 for the chain) to learn a yield that batch 1 learns for 1 ms. (A
            # measured arm's re-runs are already spaced by what they cost, above.)
            if share is not None and arm.speculates and tokens_left is not None and est is not None:
                horizon = min(tokens_left, MAX_HORIZON_TOKENS) * batch_size * chosen_cost
                run_cost = catch_up
                if (sampled, arm) not in self._yield:
                    run_cost += RUN * max(est.step - step, 0.0)
                if run_cost > 0 and run_cost > share * horizon:
                    interval = float(MAX_EXPLORE_INTERVAL)
            waited = bucket.steps - bucket.last_run.get(arm, 0)
            if waited >= interval:
                overdue.append((waited / interval, arm))
        if overdue:
            self._held = None
            return self._explore(bucket, sampled, max(overdue, key=lambda o: o[0])[1])
        self._held = (key, chosen, bucket.steps + HOLD_STEPS)
        return self._ran(bucket, chosen)

    def drafting_arm(
        self, batch_size: int, sampled: bool, arms: list[TreeBudget], lag_rows: int,
        tokens_left: float | None, closed: bool = False,
    ) -> TreeBudget | None:
        """The drafting arm ``choose`` would switch to at ``batch_size`` from autoregressive
        decoding with ``lag_rows`` rows to catch up, by the costs and yields known now (None:
        it would not draft, or too little is known to tell); ``closed``: that batch will only
        shrink (its drain is charged as ``choose`` charges it). A question, not a choice:
        nothing is explored or measured; the question and its terms are kept for diagnosis
        (``fill_questions``). A batch still being prefilled asks it of the batch it becomes, to
        catch its prompts up in their prefill (cheaper than one catch-up after it)."""
        target = batch_size.bit_length()
        estimates, best = self._cheapest(target, sampled, arms)
        answer, weighing = None, None
        if best is not None and best.speculates:
            base_cost = self._base_cost(target, sampled, arms[0], estimates[arms[0]], batch_size)
            catch_up = self.catch_up_seconds(lag_rows)
            est = estimates[best]
            if base_cost is not None and catch_up > 0 and est is not None:
                drains = closed and tokens_left is not None and self.spread.ready
                weighing = self.last_weighing = self._weigh(
                    best, est, base_cost, batch_size, sampled, catch_up, drains, tokens_left
                )
                answer = best if weighing.pays else None
        self.fill_questions.append(FillQuestion(batch_size, sampled, answer, weighing))
        self.fill_questions_asked += 1
        return answer

    def _cheapest(
        self, target: int, sampled: bool, arms: list[TreeBudget]
    ) -> tuple[dict[TreeBudget, Estimate | None], TreeBudget | None]:
        """Every arm's estimate at bucket ``target`` and the one cheapest per token (the first
        of equals; None: none measured anywhere)."""
        estimates = {arm: self.estimate(target, sampled, arm) for arm in arms}
        known = [(e.per_token, i) for i, e in enumerate(estimates.values()) if e is not None]
        return estimates, (arms[min(known)[1]] if known else None)

    def _base_cost(
        self, target: int, sampled: bool, no_spec: TreeBudget, base: Estimate | None, batch_size: int
    ) -> float | None:
        """Autoregressive decoding's seconds per token a switch to drafting is weighed against:
        measured in the bucket, at its floor cost (its steps' cost varies with the host's load,
        and a switch decided on a dear moment pays its catch-up for nothing: the H200's batch 64
        did). None: not measured there. Where its steps were only calibrated, never served, an
        autoregressive step costs at most what it does calibrated and at least what one served
        at a smaller batch does (a larger batch never makes it cheaper): the H200's step at
        batch 256 was calibrated at 1.45-1.89 ms where served ones took ~1.0-1.3 ms, batch 128's
        0.95, and the engine drafted at batch 256 where it lost 6-8% (session 32)."""
        own = self._buckets.get((target, sampled))
        measured_ar = None if own is None else own.costs.get(no_spec)
        if measured_ar is None or measured_ar.count < MIN_MEASURED or base is None:
            return None
        cost = min(base.per_token, measured_ar.floor)
        if measured_ar.served < MIN_MEASURED:
            smaller = max(
                ((b, c) for (b, s), bk in self._buckets.items()
                 if s == sampled and b < target and (c := bk.costs.get(no_spec)) is not None
                 and c.served >= MIN_MEASURED),
                key=lambda bc: bc[0], default=None,
            )  # fmt: skip
            if smaller is not None:
                served = smaller[1]
                cost = min(cost, served.floor * served.rows / max(batch_size, 1))
        return cost

    def _switch_pays(
        self, arm: TreeBudget, est: Estimate | None, base_cost: float | None, batch_size: int,
        sampled: bool, catch_up: float, drains: bool, tokens_left: float | None,
    ) -> bool:
        """Whether ``arm`` may be chosen over autoregressive decoding (``base_cost`` seconds per
        token) when a switch to it first catches up for ``catch_up`` seconds; ``drains``: the
        batch only shrinks and its spread of yields is known.

        A drafting cost only calibrated at start-up is taken as it is: a switch made on it
        serves the arm's steps, whose measured cost decides from then on. Until session 34 a
        calibrated cost had to clear a margin of 1.5 (the H200's chain at batch 256 once ran 6.4
        ms steps against 3.9 calibrated; now 3.2 against 2.6, within 5% elsewhere), and the
        margin kept the arm from ever running, so from ever being served: a closed batch that
        decodes autoregressively is latched so (``BatchChoice.latch``), and an exploring run
        has to fit a share of the batch's horizon. The H200's batches 16-256 at T=0.7 decoded
        autoregressively for 630 steps each (0.95-0.99x) against a chain calibrated at 0.43-0.73
        of their cost per token, and batches 128 and 256 did so greedy in one sweep (0.94-0.95x)
        and drafted in the next on the same model (1.12-1.20x, session 35)."""
        if not arm.speculates or (catch_up <= 0 and not drains):
            return True
        if est is None or base_cost is None:
            # Autoregressive decoding not measured here yet: its few steps cost what the
            # baseline's do, while a line extrapolated from small batches can put it at
            # ten times its cost (the H200's noise at batch 4, drawn out to 64).
            return catch_up <= 0
        self.last_weighing = self._weigh(arm, est, base_cost, batch_size, sampled, catch_up, drains, tokens_left)
        return self.last_weighing.pays

    def _weigh(
        self, arm: TreeBudget, est: Estimate, base_cost: float, batch_size: int, sampled: bool,
        catch_up: float, drains: bool, tokens_left: float | None,
    ) -> SwitchWeighing:
        """The terms a switch from autoregressive decoding to drafting ``arm`` is weighed by."""
        # An estimate extrapolated from smaller batches (a line through two of them) is
        # optimistic as far as its host work per sequence was measured short; it must
        # clear the cost by a margin growing with the doublings it spans.
        target = batch_size.bit_length()
        margin = 1.0 if est.source >= target else 1.0 + EXTRAPOLATION_MARGIN * (target - est.source)
        saving = self._saving(est, base_cost, batch_size, sampled, arm, tokens_left)
        # Charged on top of the catch-up: under speculation the batch's sequences finish at
        # different steps, the last steps carrying few of them, which steady steps do not
        # show (nor does the catch-up). From the spread of yields when it is known and
        # nothing joins the batch; else a fixed number of the arm's steps.
        if drains:
            drain = self._drain_seconds(est, batch_size, sampled, arm, tokens_left)  # type: ignore[arg-type]
        else:
            drain = DRAIN_STEPS * est.step
        return SwitchWeighing(arm, saving, catch_up, drain, margin)

    def _saving(
        self, new: Estimate, base_cost: float, batch_size: int, sampled: bool, arm: TreeBudget,
        tokens_left: float | None,
    ) -> float:
        """Seconds drafting with ``new`` saves against autoregressive decoding (``base_cost``
        seconds per token) over the horizon: the tokens the batch may still generate, at most
        ``MAX_HORIZON_TOKENS`` per sequence (a request usually stops before its max_tokens), or
        ``SWITCH_HORIZON`` steps when that is unknown. A switch to drafting must save more than
        the MTP catch-up it needs first (the prompts of requests just admitted, the tokens of
        autoregressive steps): short requests at a batch where drafting hardly wins would pay
        one per request; a batch growing through its prefill or shrinking as requests finish
        would pay one at every flip of its best arm."""
        if tokens_left is None:
            tokens_left = SWITCH_HORIZON * (self.arm_yield(sampled, arm) or 1.0)
        tokens = min(tokens_left, MAX_HORIZON_TOKENS) * batch_size
        return tokens * (base_cost - new.per_token)

    def _drain_seconds(
        self, est: Estimate, batch_size: int, sampled: bool, arm: TreeBudget, tokens_left: float
    ) -> float:
        """What the batch's sequences finishing at different steps adds to ``arm``'s steady cost
        over the horizon (``engine.spec.drain.closed_batch_seconds`` less the steady cost)."""
        mean_yield = self.arm_yield(sampled, arm) or 1.0
        steps = min(tokens_left, MAX_HORIZON_TOKENS) / max(mean_yield, 1.0)  # at the mean yield
        steps_at: dict[int, float] = {}

        def step_at(alive: float) -> float:
            bucket = max(round(alive), 1).bit_length()
            if bucket not in steps_at:
                found = self.estimate(bucket, sampled, arm)
                steps_at[bucket] = est.step if found is None else found.step
            return steps_at[bucket]

        whole = closed_batch_seconds(step_at, batch_size, steps, self.spread.quantiles())
        return max(whole - steps * step_at(batch_size), 0.0)

    def _relearn(
        self, sampled: bool, arm: TreeBudget, chosen: TreeBudget, est: Estimate, chosen_cost: float,
        catch_up: float,
    ) -> bool:
        """Whether drafting ``arm``, whose yield was measured on fewer than
        ``THIN_YIELD_SEQ_STEPS`` sequence-steps (a run or two at batch 1), is to be run again now
        to learn it: only while autoregressive decoding is chosen (a drafting arm chosen
        measures the others' yields too, ``observe_counterfactual_yield``), and only if the run
        (its catch-up, and what its steps cost beyond the chosen arm's for the tokens they
        yield) costs at most ``EXPLORE_SHARE_NEW`` of the time served since the arm last ran."""
        seen = self._yield.get((sampled, arm), (0.0, 0))[1]
        if chosen.speculates or seen >= THIN_YIELD_SEQ_STEPS:
            return False
        tokens = RUN * est.step / max(est.per_token, 1e-12)  # the run's steps, every sequence's
        run_cost = catch_up + tokens * max(est.per_token - chosen_cost, 0.0)
        return run_cost <= EXPLORE_SHARE_NEW * (self._served_s - self._explored_at.get((sampled, arm), 0.0))

    def _worth_measuring(
        self, target: int, sampled: bool, arm: TreeBudget, est: Estimate, baseline: TreeBudget,
        chosen_cost: float,
    ) -> bool:
        """Whether an arm only extrapolated to this bucket should be measured here soon: not if
        ``baseline`` (no speculation) was measured cheaper at a smaller batch (a verify step's
        cost grows with the batch, an autoregressive step's hardly does, so it loses here too);
        yes if it was extrapolated from larger batches (its step is cheaper here) or comes
        within 10% of the chosen arm."""
        if arm.speculates:
            for (b, s) in self._buckets:
                if s == sampled and b < target:
                    mine, base = self.per_token(b, s, arm), self.per_token(b, s, baseline)
                    if mine is not None and base is not None and base < mine:
                        return False
        return est.source > target or est.per_token <= 1.1 * chosen_cost

    def _filling_arm(
        self, target: int, sampled: bool, no_spec: TreeBudget, chosen: TreeBudget, batch_size: int,
        after_cost: float,
    ) -> TreeBudget:
        """The arm of a filling step whose steady choice is ``chosen``, by the filling steps
        measured in its bucket: a drafting arm only if what its filling step costs beyond the
        autoregressive one's is less than the tokens it makes beyond one per sequence are worth
        (each one the filled batch need not make later, at ``after_cost`` seconds per token)
        plus the rows an autoregressive step would leave the MTP modules to catch up.

        Drafting's filling steps are measured first (the steady costs chose it), then the
        autoregressive one's (an autoregressive step leaves the batch behind, so the fill's
        later steps decode autoregressively too: ``choose``); afterwards the arm not chosen runs
        every ``FILL_REMEASURE`` free filling choices of the bucket.

        A drafting arm picked to measure its filling steps first, or for what it is worth, is
        kept by the fill's later filling steps (``_fill_drafting``), whatever their buckets'
        costs (one picked to re-measure it is not kept: the next filling step chooses again,
        as the rows it leaves behind allow). So a bucket's first fill drafts throughout, where
        it may not pay, to learn what its filling steps cost. One filling step decoded
        autoregressively leaves the batch behind, so the fill's later steps and
        its last chunk's catch-up follow it, and the first full step loads every sequence
        afresh and catches it up (the H200's batch 256 drafting after such fills: 10-22 ms
        first full steps against ~6, rounds at 0.79-1.22x against 1.15-1.24x)."""
        if not chosen.speculates:
            return chosen
        fill = self._fill.setdefault((target, sampled), Bucket())
        mine, base = fill.costs.get(chosen), fill.costs.get(no_spec)
        keep = True
        if mine is None or mine.count < MIN_MEASURED:
            pick = chosen
        elif base is None or base.count < MIN_MEASURED:
            pick = no_spec
        else:
            extra_tokens = batch_size * max((self.arm_yield(sampled, chosen) or 1.0) - 1.0, 0.0)
            worth = extra_tokens * after_cost + self.catch_up.row_seconds(batch_size)
            drafts = mine.seconds - base.seconds < worth
            pick, other = (chosen, no_spec) if drafts else (no_spec, chosen)
            if fill.steps + 1 - fill.last_run.get(other, 0) >= FILL_REMEASURE:
                pick, keep = other, False
        self._fill_drafting = pick if keep and pick.speculates else None
        return self._fill_step(target, sampled, pick)

    def _fill_step(self, target: int, sampled: bool, arm: TreeBudget) -> TreeBudget:
        """Count a filling step of ``arm`` in bucket ``target``'s filling choices."""
        fill = self._fill.setdefault((target, sampled), Bucket())
        fill.steps += 1
        fill.last_run[arm] = fill.steps
        return arm

    def _explore(self, bucket: Bucket, sampled: bool, arm: TreeBudget) -> TreeBudget:
        self._explored_at[(sampled, arm)] = self._served_s
        self._run = (arm, RUN - 1)
        return self._ran(bucket, arm)

    def _ran(self, bucket: Bucket, arm: TreeBudget) -> TreeBudget:
        bucket.last_run[arm] = bucket.steps
        return arm
