"""Load-adaptive speculation: each step's draft budget for the current batch.

Two paths, one per way a step runs.

* **Graphed path** (GPU, and CPU with ``cuda_graphs=True``): the engine captures device steps for
  a few budgets — its tree and a chain — and the choice among them and no speculation is
  measured (``engine.spec.arms.MeasuredArms``): per batch bucket, each arm's cost per emitted
  token from its steady steps, the cheapest used, the others re-run now and then. A graph
  replay's cost is exact and cheap to measure, while no model of eager forwards predicts it.
* **Host-driven path** (CPU): the trade-off has one model (``engine.simulator``): expected
  accepted length from acceptance statistics per depth and sibling rank, and step time from a
  latency model of the verify and draft forwards measured on this device at start-up
  (``calibrate_latency``). The controller feeds it the acceptance statistics the engine measures
  online (``AcceptanceCounter``; a conservative prior until enough verify steps were seen) and
  drafts the tree (or no speculation) with the most tokens/s at the current batch size. The
  model cannot see host overhead (Python tree building), so the controller also measures what
  each decode step really cost per token, with and without speculation, per batch-size bucket
  (step time per bucket; the speculative yield per sequence pooled over the buckets drafting the
  same tree; tokens counted before max_tokens truncation); once both are measured they overrule
  the plan's yes/no in either direction. A bucket not measured yet follows measured ones by
  monotonicity (speculation winning at a larger batch wins at a smaller one, AR winning at a
  smaller batch at a larger one), else a neighbouring bucket. Whichever choice loses is still
  explored now and then: a short run of speculative steps while AR wins (rarer the costlier
  they measured), which also keeps the acceptance statistics current, or a single AR step
  while speculation wins (rarer the wider its margin). Where the plan has no tree the
  speculative steps draft the configured (maximum) tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.batch_builder import SeqRows, build_batch, causal_mask
from engine.kv.block_pool import BlockOwner
from engine.simulator import AcceptanceStats, LatencyModel, SpeculationPlanner
from engine.spec.arms import MeasuredArms, StepCost
from engine.spec.drafter import TreeBudget

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

PRIOR = AcceptanceStats.chain([0.6, 0.5, 0.45, 0.4, 0.4, 0.4])
MIN_STEPS_FOR_LIVE_STATS = 32
REPLAN_MAX_RECORDS = 16384
# Speculative steps per exploration: the first one after a run of AR steps catches the MTP modules
# up (extra work that is not measured), the others show the steady cost.
EXPLORE_RUN = 3
MIN_MEASURED = 3  # steps of each kind before a bucket's step costs count as measured
NO_SPEC = TreeBudget(topk=1, depth=0, num_draft_tokens=0)


@dataclass
class _Measured:
    """One bucket's measured choices, as seconds per emitted token."""

    spec: StepCost
    ar: StepCost
    spec_per_token: float
    ar_per_token: float


class AdaptiveController:
    def __init__(self, engine: LLMEngine, max_budget: TreeBudget, explore_every: int = 16) -> None:
        self.max_budget = max_budget
        self.explore_every = explore_every
        self.latency = calibrate_latency(engine, max_budget)
        self._planner: SpeculationPlanner | None = None
        self._planned_at_steps = 0
        self._calls = 0
        self._explore_left = 0
        # (log2 batch bucket, batch samples, speculated) -> measured decode steps
        self._steps: dict[tuple[int, bool, bool], StepCost] = {}
        self._shapes: dict[tuple[int, bool], TreeBudget] = {}  # (bucket, sampled) -> planned tree
        self._since_explore = 0
        # Tokens per sequence per speculative step of one tree shape, pooled over the buckets
        # that draft it: a bucket's few speculative steps give its step time well (it hardly
        # varies) but its yield poorly (a sampled step emits 1 to 7 tokens), which used to
        # decide on noise. (sampled, tree) -> (EWMA, steps)
        self._yield: dict[tuple[bool, TreeBudget | None], tuple[float, int]] = {}
        # The graphed path (budgets with captured device steps): measured choice among them.
        self.arms = MeasuredArms(explore_every)
        self._graphed_arms: dict[bool, list[TreeBudget]] = {}  # sampled -> captured budgets

    def observe(
        self, batch_size: int, budget: TreeBudget, seconds: float, tokens: int, sampled: bool = False
    ) -> None:
        """Record one decode step's real cost (host overhead included) and the tokens it produced
        before max_tokens / stop truncation (a request ending mid-path says nothing of the choice)."""
        if tokens <= 0:
            return
        if self._graphed_arms.get(sampled):
            self.arms.observe(batch_size, sampled, budget, seconds, tokens)
            return
        speculated = budget.speculates
        key = (batch_size.bit_length(), sampled, speculated)
        cost = self._steps.get(key)
        if cost is None:
            self._steps[key] = StepCost(seconds, float(batch_size), float(tokens), 1, seconds)
        else:
            cost.add(seconds, batch_size, tokens)
        if speculated:  # a long memory: ~50 steps
            shape = (sampled, self._shapes.get((batch_size.bit_length(), sampled)))
            mean, n = self._yield.get(shape, (0.0, 0))
            mean += (tokens / batch_size - mean) * max(0.02, 1 / (n + 1))
            self._yield[shape] = (mean, n + 1)

    def observe_catch_up(
        self, batch_size: int, budget: TreeBudget, seconds: float, lag_rows: int, sampled: bool = False
    ) -> None:
        """A speculative step that first caught the MTP modules up over ``lag_rows`` rows (after
        AR steps, a prompt, or a switch of budget): not a steady cost, but what a switch costs."""
        if self._graphed_arms.get(sampled):
            self.arms.observe_catch_up(batch_size, sampled, budget, seconds, lag_rows)

    def _costs(self, bucket: int, sampled: bool) -> _Measured | None:
        """A batch bucket's measured speculative and AR steps; None until each kind has
        MIN_MEASURED steps (fewer do not set how often to explore either: one exploring run
        must not postpone the next). Speculative cost per token uses the pooled yield."""
        spec = self._steps.get((bucket, sampled, True))
        ar = self._steps.get((bucket, sampled, False))
        if spec is None or ar is None or min(spec.count, ar.count) < MIN_MEASURED:
            return None
        own = (spec.tokens / spec.rows, 0)  # the bucket's own yield if its shape has no pool yet
        pooled = self._yield.get((sampled, self._shapes.get((bucket, sampled))), own)[0]
        return _Measured(spec, ar, spec.seconds / (spec.rows * pooled), ar.seconds / ar.tokens)

    def _explore_interval(self, batch_size: int, sampled: bool) -> int:
        """Steps between explorations of speculation while AR is measured faster: the costlier
        a speculative step is against an AR step, the rarer, so exploring stays ~1/explore_every
        of the time (sampled trees on the host path can cost tens of AR steps)."""
        costs = self._costs(batch_size.bit_length(), sampled)
        if costs is None or costs.ar.seconds <= 0:
            return self.explore_every
        return int(self.explore_every * max(1.0, costs.spec.seconds / costs.ar.seconds) * 4)

    def _margin(self, batch_size: int, sampled: bool) -> int:
        """How many times cheaper per token speculation measured than AR (at least 1): the
        wider the margin, the rarer the AR check (each costs an MTP catch-up afterwards)."""
        costs = self._costs(batch_size.bit_length(), sampled)
        if costs is None or costs.spec_per_token <= 0:
            return 1
        return max(1, int(costs.ar_per_token / costs.spec_per_token))

    def _measured_says_ar(self, batch_size: int, sampled: bool) -> bool | None:
        """Whether measured steps favour AR at this batch size; None while nothing comparable
        was measured. The bucket's own costs decide once measured. Until then other buckets
        stand in through monotonicity: a verify step's cost grows with the batch while an AR
        step's hardly does, so speculation that wins at a larger batch wins here, and AR that
        wins at a smaller batch wins here (a batch shrinking as its sequences finish at
        different steps then keeps speculating without re-measuring every bucket); failing
        that, a neighbouring bucket."""
        target = batch_size.bit_length()
        own = self._costs(target, sampled)
        if own is not None:
            return own.spec_per_token > own.ar_per_token
        measured = {b: c.spec_per_token > c.ar_per_token for b in {k[0] for k in self._steps}
                    if (c := self._costs(b, sampled)) is not None}  # fmt: skip
        if any(not says_ar for b, says_ar in measured.items() if b > target):
            return False
        if any(says_ar for b, says_ar in measured.items() if b < target):
            return True
        # Otherwise a neighbouring bucket (not a farther one: costs at batch 1 say little about
        # batch 64). Without it, a batch that starts small every time (prompts admitted over
        # several prefill chunks) would re-explore, paying a prompt-long MTP catch-up each time.
        for bucket in (target + 1, target - 1):
            if bucket in measured:
                return measured[bucket]
        return None

    def _stats(self, engine: LLMEngine) -> AcceptanceStats:
        snapshot = engine.acceptance.snapshot()
        if int(snapshot["num_steps"]) < MIN_STEPS_FOR_LIVE_STATS:  # type: ignore[call-overload]
            return PRIOR
        try:
            return AcceptanceStats.from_dict(snapshot)
        except ValueError:
            return PRIOR

    def choose(
        self, engine: LLMEngine, batch_size: int, sampled: bool = False, lag_rows: int = 0
    ) -> TreeBudget:
        """The budget for this step; ``lag_rows``: rows the MTP modules are behind."""
        arms = self._graphed_arms.get(sampled)
        if arms is None:
            arms = self._graphed_arms[sampled] = engine.graphed_budgets(sampled)
        if arms:  # graphed path: measured choice among the captured budgets and none
            return self.arms.choose(batch_size, sampled, [NO_SPEC, *arms], lag_rows)
        self._calls += 1
        # Re-plan as the acceptance statistics grow: at 32, 64, 128, ... verified sequence-steps,
        # then every REPLAN_MAX_RECORDS (planning costs milliseconds; steps cost less).
        steps = engine.acceptance.num_steps
        next_plan = min(2 * self._planned_at_steps, self._planned_at_steps + REPLAN_MAX_RECORDS)
        if self._planner is None or steps >= max(next_plan, MIN_STEPS_FOR_LIVE_STATS):
            self._planner = SpeculationPlanner(
                self._stats(engine),
                self.latency,
                budgets=range(0, self.max_budget.num_draft_tokens + 1),
                max_depth=self.max_budget.depth,
                max_width=self.max_budget.topk,
            )
            self._planned_at_steps = steps
        # Plans per power-of-two batch bucket, the one step costs are kept in (a shrinking batch
        # does not re-plan every step, and one bucket's batch sizes share one planned shape, so
        # its measured speculative costs are not thrown away when the batch crosses a power of 2).
        plan = self._planner.plan(1 << (batch_size.bit_length() - 1))
        in_run = self._explore_left > 0  # the rest of an exploring run of speculative steps
        if in_run:
            self._explore_left -= 1
        # While speculation wins, an AR step now and then checks it still does (AR steps are
        # cheap to try, so the check is rare).
        periodic = self._calls % (self.explore_every * 4 * self._margin(batch_size, sampled)) == 0
        no_spec = NO_SPEC
        if plan.budget == 0:
            # No planned tree, yet measured steps may say speculate: the "no" comes from a model
            # of eager forwards (no CUDA graphs), which can be badly wrong, and then it offers no
            # shape to trust either. Draft the configured tree: the one the fixed "tree" method
            # serves (and graphs capture), the most tokens per step where a forward costs about
            # the same for any tree size, the case the eager model misjudges. Exploring drafts
            # the same tree, so the speculative cost measured is that of the tree used.
            tree = self.max_budget
        else:
            tree = TreeBudget(
                topk=max(plan.topk, 1),
                depth=plan.max_depth,
                num_draft_tokens=plan.budget,
                min_path_prob=self.max_budget.min_path_prob,
            )
        self._forget_other_shapes(batch_size, sampled, tree)
        # Measured step costs, once there are both, decide; until then the plan does.
        measured_ar = self._measured_says_ar(batch_size, sampled)
        if measured_ar is None and plan.budget > 0:
            return tree if self._calls % 2 else no_spec  # measure both, alternating
        if measured_ar is False:
            return no_spec if periodic else tree
        # AR wins (measured so, or planned so while unmeasured): a run of speculative steps now
        # and then (its first step catches the MTP modules up and is not measured, the rest are).
        self._since_explore += 1
        due = self._since_explore >= self._explore_interval(batch_size, sampled)
        if due:
            self._since_explore = 0
            self._explore_left = EXPLORE_RUN - 1
        return tree if due or in_run else no_spec

    def _forget_other_shapes(self, batch_size: int, sampled: bool, planned: TreeBudget) -> None:
        """Speculative step costs were measured on one tree shape: when a re-plan changes the
        shape for this bucket, measure it again (AR costs stay valid)."""
        key = (batch_size.bit_length(), sampled)
        if self._shapes.get(key, planned) != planned:
            self._steps.pop((*key, True), None)
        self._shapes[key] = planned


def _grid(device: torch.device, max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    if device.type == "cpu":  # keep CPU start-up to a few seconds
        batches, tokens, limit = (1, 4, 16), (1, 2, 4, 8, 16), 64
    else:
        batches, tokens, limit = (1, 4, 16, 64, 256), (1, 2, 4, 8, 16, 32, 64), 1 << 15
    batches = tuple(b for b in batches if b <= max_batch) or (1,)
    tokens = tuple(t for t in tokens if t <= max_tokens + 1) or (1,)
    return [(b, t) for b in batches for t in tokens if b * t <= limit]


@torch.inference_mode()
def calibrate_latency(engine: LLMEngine, max_budget: TreeBudget, context: int = 64) -> LatencyModel:
    """Time real target and MTP forwards over scratch blocks; returns measured surfaces.

    On CUDA each forward is timed as a CUDA-graph replay, as the decode steps run there."""
    pool = engine.pool
    device = engine.device
    grid = _grid(device, engine.config.max_batch_size, max_budget.num_draft_tokens)
    blocks_per_seq = -(-(context + 65) // pool.block_size)
    max_b = max(b for b, _ in grid)
    max_b = min(max_b, pool.num_free // blocks_per_seq)
    grid = [(b, t) for b, t in grid if b <= max_b]
    owner = BlockOwner("latency-calibration")
    blocks = pool.allocate(blocks_per_seq * max(max_b, 1), owner)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    verify, draft = [], []
    model = engine.model
    try:
        for b, t in grid:
            rows = []
            for i in range(b):
                seq_blocks = blocks[i * blocks_per_seq : (i + 1) * blocks_per_seq]
                ids = torch.randint(0, vocab, (t,), generator=gen).tolist()
                rows.append(
                    SeqRows(
                        seq_blocks, context, ids, list(range(context, context + t)), causal_mask(t)
                    )
                )
            ids_t, batch = build_batch(rows, pool.block_size, device)
            hidden = torch.zeros(
                ids_t.shape[0],
                engine.model_config.hidden_size,
                device=device,
                dtype=next(engine.model.parameters()).dtype,
            )
            verify_s = _time(
                lambda i=ids_t, bt=batch: model.logits(  # type: ignore[misc]
                    model.forward_target(i, bt, pool.kv_cache)
                ),
                device,
            )
            verify.append({"batch_size": b, "tokens": t, "seconds": verify_s})
            if engine.model_config.num_mtp_modules:
                draft_s = _time(
                    lambda i=ids_t, bt=batch, h=hidden: model.logits(  # type: ignore[misc]
                        model.forward_mtp(1, h, i, bt, pool.kv_cache)
                    ),
                    device,
                )
                draft.append({"batch_size": b, "tokens": t, "seconds": draft_s})
    finally:
        pool.free(blocks)  # zeroes what the calibration wrote
    measurements: dict[str, object] = {"verify": verify}
    if draft:
        measurements["draft_per_depth"] = draft
    return LatencyModel.fit(measurements)


def _time(fn: object, device: torch.device, repeats: int = 3) -> float:
    """Best of ``repeats`` runs of ``fn``: on CUDA as replays of a CUDA graph of it (how the
    decode steps run there: launches cost nothing, only the kernels), eagerly elsewhere or when
    capture fails."""
    run = fn  # type: ignore[assignment]
    run()  # type: ignore[operator]  # warm-up (Triton compiles)
    if device.type == "cuda":
        graph = _capture(run)  # type: ignore[arg-type]
        if graph is not None:
            run = graph.replay
            run()  # the first replay uploads the graph
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """A CUDA graph of ``fn`` (its inputs are fixed tensors), None when capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
    except RuntimeError:
        torch.cuda.synchronize()
        return None
