"""engine/spec/adaptive.py: the arms each path offers, and measurement deciding among them.

The controller is driven without a model: a stub engine (no acceptance statistics yet, so the
prior) and a fixed latency model in place of the calibration. The choice among arms itself is
tested in ``test_arms.py``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.simulator import LatencyModel, SpeculationPlanner
from engine.spec import adaptive
from engine.spec.acceptance_stats import AcceptanceCounter
from engine.spec.adaptive import NO_SPEC, AdaptiveController
from engine.spec.drafter import TreeBudget

MAX = TreeBudget(topk=4, depth=6, num_draft_tokens=32)
CHAIN = TreeBudget(topk=1, depth=4, num_draft_tokens=4)
PLAN_SAYS_AR = LatencyModel.analytic(verify_fixed=1e-6, verify_per_token=0.01)
PLAN_SAYS_SPEC = LatencyModel.analytic(verify_fixed=0.01, verify_per_token=1e-6)
STEPS = 400
BATCH = 4


def _controller(
    monkeypatch: pytest.MonkeyPatch, latency: LatencyModel, graphed: bool = False
) -> tuple[SimpleNamespace, AdaptiveController]:
    monkeypatch.setattr(adaptive, "calibrate_latency", lambda engine, budget: latency)
    arms = [MAX, CHAIN] if graphed else []
    eng = SimpleNamespace(
        acceptance=AcceptanceCounter(), graphed_budgets=lambda sampled: [] if sampled else arms
    )
    return eng, AdaptiveController(eng, MAX, {False: [CHAIN], True: [CHAIN]})  # type: ignore[arg-type]


def _drive(
    eng: SimpleNamespace, controller: AdaptiveController, costs: dict[bool, tuple[float, int]]
) -> list[TreeBudget]:
    """STEPS decode steps as ``LLMEngine.step`` runs them: a drafting step costs ``costs[True]``
    (seconds, tokens), an AR step ``costs[False]``; a drafting step right after AR steps first
    catches the MTP modules up (reported as such). Returns the budgets chosen."""
    chosen: list[TreeBudget] = []
    lag = 0
    for _ in range(STEPS):
        budget = controller.choose(eng, BATCH, lag_rows=lag)  # type: ignore[arg-type]
        seconds, tokens = costs[budget.speculates]
        if budget.speculates and lag:
            controller.observe_catch_up(BATCH, budget, seconds + 1e-5 * lag, lag)
            lag = 0
        else:
            controller.observe(BATCH, budget, seconds, tokens)
            lag += 0 if budget.speculates else BATCH
        chosen.append(budget)
    return chosen


def test_host_path_offers_a_chain_and_the_planned_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's batch-1 tree (a real tree when drafting pays in its model) and a chain; where
    its model says drafting never pays, the configured tree stands in (measurement decides)."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_SPEC)
    tree = controller._planned_tree(eng)  # type: ignore[arg-type]
    assert tree.speculates and tree.num_draft_tokens <= MAX.num_draft_tokens and tree != CHAIN
    chosen = {controller.choose(eng, BATCH) for _ in range(20)}  # type: ignore[arg-type]
    assert chosen <= {NO_SPEC, CHAIN, tree} and len(chosen) == 3, "every arm is measured first"
    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR)
    assert controller._planned_tree(eng) == MAX  # type: ignore[arg-type]


@pytest.mark.parametrize("graphed", [False, True])
def test_measured_costs_decide_whatever_the_plan(monkeypatch: pytest.MonkeyPatch, graphed: bool) -> None:
    """A plan saying drafting never pays is overruled by drafting steps measured 2x cheaper per
    token, and one saying it pays by drafting steps measured 2x costlier; the losing choice is
    still re-run now and then."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR, graphed)
    chosen = _drive(eng, controller, {True: (0.02, 16), False: (0.01, 4)})  # 1.25 vs 2.5 ms/token
    tail = chosen[40:]
    assert sum(b.speculates for b in tail) >= 0.9 * len(tail)
    assert any(not b.speculates for b in tail), "AR is still checked once measured"
    eng, controller = _controller(monkeypatch, PLAN_SAYS_SPEC, graphed)
    chosen = _drive(eng, controller, {True: (0.04, 8), False: (0.01, 4)})  # 5 vs 2.5 ms/token
    tail = chosen[40:]
    assert sum(b.speculates for b in tail) <= 0.1 * len(tail)


def test_graphed_path_chooses_among_the_captured_budgets_by_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With captured device steps the arms are the captured budgets; the cheapest per token
    carries the steps and the others are re-run now and then."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR, graphed=True)
    costs = {NO_SPEC: (0.01, 4), CHAIN: (0.012, 12), MAX: (0.02, 16)}  # per token: 2.5, 1, 1.25 ms
    chosen = []
    for _ in range(STEPS):
        budget = controller.choose(eng, BATCH)  # type: ignore[arg-type]
        chosen.append(budget)
        controller.observe(BATCH, budget, *costs[budget])
    assert {NO_SPEC, CHAIN, MAX} <= set(chosen[:12]), "every arm is measured first"
    assert chosen[40:].count(CHAIN) >= 0.8 * len(chosen[40:])
    assert NO_SPEC in chosen[40:] and MAX in chosen[40:], "the others are re-run now and then"


def test_the_arms_yields_are_the_simulators_under_the_live_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """One model of the trade-off: once enough verify steps are counted, each captured budget's
    yield is the simulator's expected length of its shape (the optimiser's tree for the tree
    budget, the chain for the chain) under the live statistics, re-predicted as they grow by a
    quarter, at most every PREDICT_EVERY choices (a prediction costs milliseconds of host time)."""
    from engine.simulator import AcceptanceStats, TreeShape, expected_length, optimal_tree

    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR, graphed=True)
    controller.choose(eng, 1)  # type: ignore[arg-type]
    prior = controller.prior[False]
    assert controller.arms.arm_yield(False, CHAIN) == pytest.approx(
        expected_length(TreeShape.chain(CHAIN.depth), prior)
    ), "no statistics yet: the prior's yields"
    for i in range(40):  # paths accepted to depth 1..4 through ranks 0 and 1
        a = 1 + i % 4
        eng.acceptance.record_path([True] * (a + 1), [i % 2 if d == 0 else 0 for d in range(a)])
    controller.choose(eng, 1)  # type: ignore[arg-type]
    stats = AcceptanceStats.from_dict(eng.acceptance.snapshot())
    tree = expected_length(optimal_tree(stats, MAX.num_draft_tokens, MAX.depth, MAX.topk), stats)
    chain = expected_length(TreeShape.chain(CHAIN.depth), stats)
    assert controller.arms.arm_yield(False, MAX) == pytest.approx(tree)
    assert controller.arms.arm_yield(False, CHAIN) == pytest.approx(chain)
    assert tree > chain > 1.0
    for _ in range(5):  # 45 steps: under a quarter more, the prediction stands
        eng.acceptance.record_path([True], [])
    controller.choose(eng, 1)  # type: ignore[arg-type]
    assert controller.arms.arm_yield(False, MAX) == pytest.approx(tree)
    for _ in range(20):  # 65 steps: a quarter more, but within PREDICT_EVERY choices
        eng.acceptance.record_path([True], [])
    controller.choose(eng, 1)  # type: ignore[arg-type]
    assert controller.arms.arm_yield(False, MAX) == pytest.approx(tree)
    for _ in range(adaptive.PREDICT_EVERY):  # then re-predicted (root-only paths lower depth 1's rate)
        controller.choose(eng, 1)  # type: ignore[arg-type]
    assert controller.arms.arm_yield(False, MAX) < tree


def test_chain_steps_do_not_dilute_the_trees_predicted_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain step offers rank 0 only. Counted as offering every rank (the rates' old
    denominator), its steps read as the tree's siblings rejected and the tree's predicted yield
    fell the more the chain ran; counted as offering rank 0, chain steps with the tree's rank-0
    rates leave the tree's prediction where the tree's own steps put it."""
    from engine.simulator import AcceptanceStats, expected_length, optimal_tree

    def record_tree_steps(counter: AcceptanceCounter) -> None:  # a third accept rank 1 at depth 1
        for i in range(42):
            if i % 3 == 0:
                counter.record_path([True, True], [1], [MAX.topk] * 2)
            else:
                counter.record_path([True] * 4, [0, 0, 0], [MAX.topk] * 4)

    def tree_yield(stats: AcceptanceStats) -> float:
        return expected_length(optimal_tree(stats, MAX.num_draft_tokens, MAX.depth, MAX.topk), stats)

    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR, graphed=True)
    tree_only = AcceptanceCounter()
    record_tree_steps(tree_only)
    record_tree_steps(eng.acceptance)
    for i in range(90):  # chain steps with the tree's rank-0 rates at every depth (2/3, 2/3, 1, 0)
        if i % 9 < 3:
            eng.acceptance.record_path([True], [], [1])
        elif i % 9 < 5:
            eng.acceptance.record_path([True, True], [0], [1, 1])
        else:
            eng.acceptance.record_path([True] * 4, [0, 0, 0], [1] * 4)
    controller.choose(eng, 1)  # type: ignore[arg-type]
    own = tree_yield(AcceptanceStats.from_dict(tree_only.snapshot()))
    assert controller.arms.arm_yield(False, MAX) == pytest.approx(own)
    snap = eng.acceptance.snapshot()
    old_denominators = AcceptanceStats.from_counts(snap["depth_rank_accepted"], snap["depth_reached"])  # type: ignore[arg-type]
    assert tree_yield(old_denominators) < own - 0.1, "what the chain steps did to the tree before"


def test_the_host_path_leaves_the_model_to_its_planned_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without captured steps the planner's tree is the model's pick already: its arms' yields
    stay measured (no prior from the model on top)."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_SPEC, graphed=False)
    for i in range(40):
        a = 1 + i % 4
        eng.acceptance.record_path([True] * (a + 1), [0] * a)
    controller.choose(eng, 1)  # type: ignore[arg-type]
    assert controller.arms.arm_yield(False, CHAIN) is None
    assert controller.arms.arm_yield(False, controller._planned_tree(eng)) is None  # type: ignore[arg-type]


def test_before_live_statistics_the_arms_are_valued_by_the_model_folders_prior(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prior set from the model folder (``engine.spec.acceptance_prior``) gives the captured
    arms their yields before any verify step, greedy and sampled each from its own rates;
    live statistics replace it once enough verify steps are counted."""
    from engine.simulator import AcceptanceStats, TreeShape, expected_length, optimal_tree

    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR, graphed=True)
    eng.graphed_budgets = lambda sampled: [MAX, CHAIN]
    eng.sampled_acceptance = AcceptanceCounter()
    good, poor = AcceptanceStats.chain([0.9] * 8), AcceptanceStats.chain([0.3] * 8)
    controller.prior = {False: good, True: poor}
    controller.choose(eng, 1)  # type: ignore[arg-type]
    controller.choose(eng, 1, sampled=True)  # type: ignore[arg-type]
    for sampled, stats in ((False, good), (True, poor)):
        tree = optimal_tree(stats, MAX.num_draft_tokens, MAX.depth, MAX.topk)
        assert controller.arms.arm_yield(sampled, MAX) == pytest.approx(expected_length(tree, stats))
        chain = expected_length(TreeShape.chain(CHAIN.depth), stats)
        assert controller.arms.arm_yield(sampled, CHAIN) == pytest.approx(chain)
    assert controller.arms.arm_yield(False, CHAIN) > 3.0 > controller.arms.arm_yield(True, CHAIN)  # type: ignore[operator]
    for _ in range(adaptive.MIN_STEPS_FOR_LIVE_STATS):  # every path stops at the root
        eng.acceptance.record_path([True], [], [1])
    controller.choose(eng, 1)  # type: ignore[arg-type]
    assert controller.arms.arm_yield(False, CHAIN) == pytest.approx(1.0), "live statistics replace it"


def test_the_prior_is_applied_again_after_the_measurements_are_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reset_measurements`` (after the start-up calibration) starts the arms afresh: the prior's
    yields come back with the next choice rather than being remembered as set."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR, graphed=True)
    controller.choose(eng, 1)  # type: ignore[arg-type]
    before = controller.arms.arm_yield(False, CHAIN)
    assert before is not None
    controller.reset_measurements()
    assert controller.arms.arm_yield(False, CHAIN) is None
    controller.choose(eng, 1)  # type: ignore[arg-type]
    assert controller.arms.arm_yield(False, CHAIN) == pytest.approx(before)


def test_a_replan_changes_the_host_paths_tree_only_for_a_clearly_faster_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each new planned tree is an arm to measure, so a re-plan keeps the tree unless the
    planner's best is predicted more than ``REPLAN_MARGIN`` faster than the tree's budget:
    after the last re-plan the tree is within the margin of the best, and statistics near a
    boundary between chains give fewer trees than with no margin."""
    near_tie = LatencyModel.analytic(verify_fixed=0.01, verify_per_token=0.0005, draft_fixed=0.001)

    def planned_trees(margin: float) -> tuple[list[TreeBudget], SpeculationPlanner]:
        monkeypatch.setattr(adaptive, "REPLAN_MARGIN", margin)
        eng, controller = _controller(monkeypatch, near_tie)
        rng = random.Random(1)
        trees = [controller._planned_tree(eng)]  # type: ignore[arg-type]
        for _ in range(2048):  # re-planned at 32, 64, ..., 2048 verify steps
            accepted = 0
            while accepted < MAX.depth and rng.random() < 0.8:
                accepted += 1
            eng.acceptance.record_path([True] * (accepted + 1), [0] * accepted)
            tree = controller._planned_tree(eng)  # type: ignore[arg-type]
            if tree != trees[-1]:
                trees.append(tree)
        planner = SpeculationPlanner(
            controller._stats(eng), near_tie, budgets=range(MAX.num_draft_tokens + 1),  # type: ignore[arg-type]
            max_depth=MAX.depth, max_width=MAX.topk,
        )  # fmt: skip
        return trees, planner

    kept, planner = planned_trees(adaptive.REPLAN_MARGIN)
    best, own = planner.plan(1), planner.plan_for_budget(1, kept[-1].num_draft_tokens)
    assert best.tokens_per_s <= (1 + adaptive.REPLAN_MARGIN) * own.tokens_per_s
    churned, _ = planned_trees(0.0)
    assert len(kept) < len(churned)
