"""Load-adaptive speculation: each step's draft budget for the current batch.

The choice is measured (``engine.spec.arms.MeasuredArms``): for each batch-size bucket, the
candidate budgets ("arms") and no speculation each have a cost per emitted token from their
steady steps; the cheapest is used, the others are re-run at a cadence set by what a run costs,
and a switch to drafting must win back the MTP catch-up it needs (see that module). A step's
cost is measured whole, host work included, which no latency model of forwards captures.

The arms:

* **graphed path** (GPU, and CPU with ``cuda_graphs=True``): the budgets the engine captured
  device steps for — its tree (the optimiser's default shape) and a chain — each one's step
  time at every batch bucket calibrated at start-up on a GPU (``calibrate_arms``:
  ``engine.spec.arm_calibration``);
* **host-driven path** (CPU): a chain, and the tree the simulator's planner
  (``engine.simulator.SpeculationPlanner``) finds best at batch 1 for the acceptance statistics
  measured so far (a conservative prior until enough verify steps were seen) and a latency
  model of target and MTP forwards calibrated on this device before the first plan
  (``calibrate_latency``; on CUDA the forwards are timed as CUDA-graph replays). It is re-planned
  as the statistics grow; a new tree is a new arm, measured afresh.

So the optimiser gives the shapes, the simulator the tokens each captured arm yields per step
under the live acceptance statistics (``_predict_yields``: the prior ``MeasuredArms`` calibrates
with each arm's measured yield; on the host path the planner's re-planned tree carries the
model instead), and the measured step costs decide, per batch size, whether and which to draft:
one model of the trade-off, with the latency side measured rather than modelled.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.batch_builder import SeqRows, build_batch, causal_mask
from engine.kv.block_pool import BlockOwner
from engine.params import SamplingParams
from engine.sequence import SeqStatus, Sequence
from engine.simulator import (
    AcceptanceStats,
    LatencyModel,
    SpeculationPlanner,
    TreePlan,
    TreeShape,
    expected_length,
    optimal_tree,
)
from engine.spec.acceptance_prior import DEFAULT_PRIOR
from engine.spec.arm_calibration import ArmTiming, calibrate_arms
from engine.spec.arm_measurements import YIELD_PRIOR_SEQ_STEPS
from engine.spec.arms import MeasuredArms
from engine.spec.drafter import TreeBudget, steady_catch_up_rows

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

MIN_STEPS_FOR_LIVE_STATS = 32
REPLAN_MAX_RECORDS = 16384
# A re-plan replaces the host path's tree only if its predicted speed beats the old budget's by
# this much: every new tree is an arm to measure, and the plans of neighbouring budgets are
# within a few percent of each other (the demo model on a CPU re-planned chains of 1, 2, 3 and 5
# in its first 200 steps, each explored in turn at batch 8, where none paid).
REPLAN_MARGIN = 0.05
PREDICT_GROWTH = 1.25  # the arms' yields are re-predicted when the statistics grow by this factor
PREDICT_EVERY = 256  # ... and at least this many choices passed (a prediction costs ~2 ms)
# Sequence-steps of measurement the prior's yields count as: a few, as it knows rank 0 only (a
# tree's siblings, which caught 84% of the chain's misses at depth 1 on the H200, are not in a
# training log), so it under-predicts trees; weighing as live statistics do (16), it kept the
# H200's batch 1 on the chain for 33 of 217 steps after the tree's first run measured 5 tokens.
PRIOR_WEIGHT_SEQ_STEPS = 1.0
NO_SPEC = TreeBudget(topk=1, depth=0, num_draft_tokens=0)


class AdaptiveController:
    def __init__(
        self, engine: LLMEngine, max_budget: TreeBudget, chains: dict[bool, list[TreeBudget]],
        explore_every: int = 16,
    ) -> None:
        self.max_budget = max_budget
        if not chains.get(False) or not chains.get(True):
            raise ValueError("adaptive speculation needs at least one chain arm for greedy and for sampled batches")
        # sampled -> the chain arms of such batches (``engine.spec.defaults.chain_budgets``).
        self._chains = chains
        # Calibrated at start-up for the host path (``calibrate_if_planning``); the graphed
        # path never plans, and on a GPU the calibration captures dozens of graphs.
        self.latency: LatencyModel | None = None
        self.arms = MeasuredArms(explore_every)
        self._tree: TreeBudget | None = None  # the host path's planned tree
        self._planned_at_steps = 0
        self._graphed_arms: dict[bool, list[TreeBudget]] = {}  # sampled -> captured budgets
        self.steps_per_arm: Counter[TreeBudget] = Counter()  # decode steps per chosen budget
        # sampled -> (verify steps counted, choices made) when the captured arms' yields were
        # last predicted.
        self._predicted_at: dict[bool, tuple[int, int]] = {}
        # The acceptance assumed before live statistics, per kind of step (sampled or not):
        # the model folder's (``engine.spec.acceptance_prior``; ``from_pretrained`` sets it).
        self.prior: dict[bool, AcceptanceStats] = {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}
        self._choices = 0  # choices made (``choose`` calls)
        # An arm every step takes while set (start-up calibration: ``engine.spec.arm_calibration``).
        self.forced: TreeBudget | None = None
        # The graphed arms' step times calibrated at start-up (empty: not calibrated).
        self.calibration: list[ArmTiming] = []

    @property
    def chain(self) -> TreeBudget:
        """The first chain arm of greedy batches (``CHAIN_DEPTH`` deep by default)."""
        return self._chains[False][0]

    def chains_for(self, sampled: bool) -> list[TreeBudget]:
        """The chain arms of sampled (or greedy) batches."""
        return self._chains[sampled]

    def snapshot(self) -> dict[str, object]:
        """What the controller has measured, for ``LLMEngine.acceptance_snapshot``:
        ``relative_yields`` (once enough sequences finished), ``arm_costs`` and ``fill_costs``
        (once any step was measured)."""
        out: dict[str, object] = {}
        arms = self.arms
        if arms.spread.ready:
            out["relative_yields"] = list(arms.spread.quantiles())
        costs = arms.cost_table()
        if costs:
            out["arm_costs"] = [
                {"batch_size": cost.rows, "sampled": sampled, "arm": budget_label(arm),
                 "topk": arm.topk if arm.speculates else 0, "depth": arm.depth,
                 "num_draft_tokens": arm.num_draft_tokens, "step_seconds": cost.seconds,
                 "tokens_per_seq": arms.tokens_per_seq(sampled, arm, cost), "steps": cost.count}
                for sampled, arm, cost in costs
            ]  # fmt: skip
        fills = arms.fill_cost_table()
        if fills:
            out["fill_costs"] = [
                {"batch_size": cost.rows, "sampled": sampled, "arm": budget_label(arm),
                 "step_seconds": cost.seconds, "steps": cost.count}
                for sampled, arm, cost in fills
            ]  # fmt: skip
        return out

    def calibrate_arms(self, engine: LLMEngine) -> None:
        """Time every captured arm at every batch bucket now (``engine.spec.arm_calibration``)
        and start from those step times: no run of an arm is needed to learn what a step of it
        costs, only one to learn its yield (``MeasuredArms.choose``), where its catch-up fits."""
        self.calibration = calibrate_arms(engine, NO_SPEC)
        for t in self.calibration:
            self.arms.seed_cost(t.batch_size, t.sampled, t.arm, t.seconds)

    def reset_measurements(self) -> None:
        """Forget the step costs, yields and choices measured so far (the catch-up cost stays:
        it was calibrated, and catch-ups are the same work whatever prompt they run over)."""
        catch_up = self.arms.catch_up
        self.arms = MeasuredArms(self.arms.explore_every)
        self.arms.catch_up = catch_up
        self.steps_per_arm.clear()
        self._predicted_at.clear()

    def calibrate_if_planning(self, engine: LLMEngine) -> None:
        """Time the latency model now when this engine plans host-path trees (no captured
        steps), as it starts, rather than inside the first request (1.3 s on the CPU demo)."""
        if self.latency is None and not engine.graphed_budgets(False):
            self.latency = calibrate_latency(engine, self.max_budget)

    def observe(
        self, batch_size: int, budget: TreeBudget, seconds: float, tokens: int, sampled: bool = False
    ) -> None:
        """Record one steady decode step's real cost (host overhead included) and the tokens it
        produced before max_tokens / stop truncation (a request ending mid-path says nothing of
        the choice)."""
        self.arms.observe(batch_size, sampled, budget, seconds, tokens)

    def observe_filling(
        self, batch_size: int, budget: TreeBudget, seconds: float, tokens: int, sampled: bool = False
    ) -> None:
        """Record one whole engine step that prefilled and decoded ``batch_size`` sequences with
        ``budget`` (``MeasuredArms.observe_filling``)."""
        self.arms.observe_filling(batch_size, sampled, budget, seconds, tokens)

    def observe_catch_up(
        self, batch_size: int, budget: TreeBudget, seconds: float, lag_rows: int,
        sampled: bool = False, timed_alone: bool = False,
    ) -> None:
        """A speculative step that first caught the MTP modules up over ``lag_rows`` rows (after
        AR steps, a prompt, or a switch of budget): not a steady cost, but what a switch costs.
        ``seconds``: the whole step, or the catch-up alone when ``timed_alone``."""
        self.arms.observe_catch_up(batch_size, sampled, budget, seconds, lag_rows, timed_alone)

    def choose(
        self, engine: LLMEngine, batch_size: int, sampled: bool = False, lag_rows: int = 0,
        tokens_left: float | None = None, filling: bool = False, closed: bool = False,
        filled_batch: int | None = None,
    ) -> TreeBudget:
        """The budget for this step; ``lag_rows``: rows the MTP modules are behind;
        ``tokens_left``: tokens each sequence may still generate, on average; ``filling``:
        requests are being admitted into the batch (``filled_batch``: the size it is headed
        for); ``closed``: none waits or is in prefill (``MeasuredArms.choose``)."""
        if self.forced is not None:
            return self.forced
        self._choices += 1
        arms = self._captured_arms(engine, sampled)
        if arms:
            self._predict_yields(engine, sampled, arms)
        else:  # host-driven path: the planner's tree is already the model's choice
            tree = self._planned_tree(engine)
            chains = self.chains_for(sampled)
            arms = [*chains, *([] if tree in chains else [tree])]
        chosen = self.arms.choose(
            batch_size, sampled, [NO_SPEC, *arms], lag_rows, tokens_left, filling, closed, filled_batch
        )
        self.steps_per_arm[chosen] += 1
        return chosen

    def drafting_arm(
        self, engine: LLMEngine, batch_size: int, sampled: bool, lag_rows: int,
        tokens_left: float | None, closed: bool,
    ) -> TreeBudget | None:
        """The captured drafting arm a batch of ``batch_size`` would switch to from
        autoregressive decoding over ``lag_rows`` rows behind (``MeasuredArms.drafting_arm``),
        None if it would not draft; no choice is made or counted. None also on the host path
        (it plans from live statistics as it goes) and while an arm is forced (calibration)."""
        if self.forced is not None:
            return None
        arms = self._captured_arms(engine, sampled)
        if not arms:
            return None
        self._predict_yields(engine, sampled, arms)
        return self.arms.drafting_arm(batch_size, sampled, [NO_SPEC, *arms], lag_rows, tokens_left, closed)

    def _captured_arms(self, engine: LLMEngine, sampled: bool) -> list[TreeBudget]:
        """The budgets the engine captured device steps for (greedy or sampled; empty on the
        host path), looked up once."""
        arms = self._graphed_arms.get(sampled)
        if arms is None:
            arms = self._graphed_arms[sampled] = engine.graphed_budgets(sampled)
        return arms

    def _predict_yields(self, engine: LLMEngine, sampled: bool, arms: list[TreeBudget]) -> None:
        """Hand the captured arms the simulator's yield of each drafting budget under the live
        acceptance statistics (greedy or sampled steps'), re-predicted as they grow by a
        quarter: the expected length of a chain, or of the optimiser's tree for the budget (the
        graphed greedy tree picks its nodes by the draft's own probabilities each step, which
        the optimal fixed shape stands for; the sampled tree drafts that shape). The counters
        pool every arm's steps, each sibling rank's rate over the nodes that offered it (a
        chain step offers rank 0 only: counted as offering every rank, it had lowered the
        tree's rates the more the chain ran, the H200's batch 1 giving the chain 20 of 73 steps).

        Graphed path only (its arms are fixed at start-up). The host path's tree arm is the
        planner's pick from the same model, re-planned as the statistics grow, so the model is
        already in its choice; a prior on top would favour the planner's deep chains, which
        the model over-predicts greedy (README, Known gaps)."""
        counter = engine.sampled_acceptance if sampled else engine.acceptance
        steps = counter.num_steps
        known = self._predicted_at.get(sampled)
        if steps < MIN_STEPS_FOR_LIVE_STATS:
            # Until then, the prior's (``engine.spec.acceptance_prior``): with no yield, a
            # drafting arm must be run to be valued, and at a batch whose catch-up no exploring
            # run may pay for (256 prompts) the engine never drafted.
            if self.arms.predicted_yield(sampled, arms[0]) is None:  # set once (until a reset)
                self._set_yields(sampled, arms, self.prior[sampled], PRIOR_WEIGHT_SEQ_STEPS)
            return
        # Re-predicted as the statistics grow by a quarter, but not within PREDICT_EVERY choices
        # of the last: the optimiser's tree costs ~2 ms of host time on the H200's host, and
        # re-predicting at every quarter took 0.2-0.35 ms per step at batches 1-16 there.
        if known is not None and (steps < known[0] * PREDICT_GROWTH or self._choices < known[1] + PREDICT_EVERY):
            return
        try:
            stats = AcceptanceStats.from_dict(counter.snapshot())
        except ValueError:  # counters not yet usable (e.g. no node ever offered children)
            return
        self._set_yields(sampled, arms, stats)
        self._predicted_at[sampled] = (steps, self._choices)

    def _set_yields(
        self, sampled: bool, arms: list[TreeBudget], stats: AcceptanceStats, weight: float = YIELD_PRIOR_SEQ_STEPS
    ) -> None:
        for arm in arms:
            tokens = expected_length(self._shape(arm, stats), stats)
            self.arms.set_predicted_yield(sampled, arm, tokens, weight)

    @staticmethod
    def _shape(arm: TreeBudget, stats: AcceptanceStats) -> TreeShape:
        """The shape a captured arm stands for: a chain, or the optimiser's tree for its budget."""
        if arm.topk == 1:
            return TreeShape.chain(arm.depth)
        return optimal_tree(stats, arm.num_draft_tokens, arm.depth, arm.topk)

    def _planned_tree(self, engine: LLMEngine) -> TreeBudget:
        """The planner's best tree at batch 1, re-planned at 32, 64, 128, ... verified
        sequence-steps, then every REPLAN_MAX_RECORDS (planning costs milliseconds). Where it
        plans no tree (its forwards-only latency model says drafting never pays), the configured
        tree: measurement has the last word."""
        steps = engine.acceptance.num_steps
        next_plan = min(2 * self._planned_at_steps, self._planned_at_steps + REPLAN_MAX_RECORDS)
        if self._tree is None or steps >= max(next_plan, MIN_STEPS_FOR_LIVE_STATS):
            if self.latency is None:
                self.latency = calibrate_latency(engine, self.max_budget)
            planner = SpeculationPlanner(
                self._stats(engine),
                self.latency,
                budgets=range(0, self.max_budget.num_draft_tokens + 1),
                max_depth=self.max_budget.depth,
                max_width=self.max_budget.topk,
            )
            plan = planner.plan(1)
            if plan.budget == 0:
                self._tree = self.max_budget
            elif self._tree is None or not self._kept(planner, plan, self._tree):
                self._tree = TreeBudget(
                    topk=max(plan.topk, 1), depth=plan.max_depth, num_draft_tokens=plan.budget,
                    min_path_prob=self.max_budget.min_path_prob,
                )  # fmt: skip
            self._planned_at_steps = steps
        return self._tree

    @staticmethod
    def _kept(planner: SpeculationPlanner, plan: TreePlan, tree: TreeBudget) -> bool:
        """Whether the planned ``tree`` stays against the new ``plan``: the best shape of its
        budget is predicted within ``REPLAN_MARGIN`` of the plan's speed at batch 1."""
        if tree.num_draft_tokens not in planner.candidates:
            return False
        kept = planner.plan_for_budget(1, tree.num_draft_tokens)
        return plan.tokens_per_s <= (1.0 + REPLAN_MARGIN) * kept.tokens_per_s

    def _stats(self, engine: LLMEngine) -> AcceptanceStats:
        snapshot = engine.acceptance.snapshot()
        if int(snapshot["num_steps"]) < MIN_STEPS_FOR_LIVE_STATS:  # type: ignore[call-overload]
            return self.prior[False]
        try:
            return AcceptanceStats.from_dict(snapshot)
        except ValueError:
            return self.prior[False]


def budget_label(budget: TreeBudget) -> str:
    """``none``, ``chain-D`` or ``tree-KxD-N`` (as the benchmark's --tree-budgets)."""
    if not budget.speculates:
        return "none"
    if budget.topk == 1:
        return f"chain-{budget.depth}"
    return f"tree-{budget.topk}x{budget.depth}-{budget.num_draft_tokens}"


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


@torch.inference_mode()
def calibrate_catch_up(
    engine: LLMEngine, prompts: tuple[int, ...] | None = None, rows_per_prompt: int = 64
) -> list[tuple[int, float]]:
    """Time the MTP catch-up over ``prompts`` sequences of ``rows_per_prompt`` rows each (best of
    two runs): (rows, seconds) points for ``engine.spec.catch_up_cost``. Scratch sequences over
    scratch blocks, freed (zeroed) after; the catch-up is the engine's own (``MTPDrafter.
    catch_up``), as a switch to drafting runs it. Default sizes: 1, 16 and 64 prompts on a GPU
    (its fixed cost of launches is most of a small catch-up), 1 and 4 on a CPU."""
    drafter, pool = engine.drafter, engine.pool
    if drafter is None:
        return []
    if prompts is None:
        prompts = (1, 4) if engine.device.type == "cpu" else (1, 16, 64)
    cfg = engine.model_config
    # Rows the engine counts as behind exclude a steady step's (``engine.spec.batch_choice.summarize``).
    slack = steady_catch_up_rows(engine.budget.depth)
    # Within the context (a short one has short prompts to catch up over anyway).
    rows_per_prompt = min(rows_per_prompt, engine.max_model_len - slack - 2)
    if rows_per_prompt < 1:
        return []
    length = rows_per_prompt + slack + 1  # tokens: the last one is the pending token
    blocks_per_seq = -(-(length + 1) // pool.block_size)
    dtype = next(engine.model.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    points = []
    for n in prompts:
        if n * blocks_per_seq > pool.num_free or n > engine.config.max_batch_size:
            break
        owner = BlockOwner("catch-up-calibration")
        blocks = pool.allocate(n * blocks_per_seq, owner)
        try:
            best = float("inf")
            for _ in range(2):  # the first run compiles kernels for new shapes
                seqs = []
                for i in range(n):
                    seq = Sequence(f"calibration-{i}", torch.randint(0, cfg.vocab_size, (length,), generator=gen)
                                   .tolist(), SamplingParams(), gen, num_mtp_modules=cfg.num_mtp_modules)  # fmt: skip
                    seq.status = SeqStatus.RUNNING
                    seq.block_ids = blocks[i * blocks_per_seq : (i + 1) * blocks_per_seq]
                    seq.num_committed = length - 1
                    hidden = torch.randn(length - 1, cfg.hidden_size, generator=gen).to(engine.device, dtype)
                    seq.push_hidden(0, 0, hidden)
                    seqs.append(seq)
                engine.wait_for_device()
                start = time.perf_counter()
                drafter.catch_up(seqs)
                engine.wait_for_device()
                best = min(best, time.perf_counter() - start)
            points.append((n * rows_per_prompt, best))
        finally:
            pool.free(blocks)  # zeroes what the catch-up wrote
    return points


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
