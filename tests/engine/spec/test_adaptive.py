"""engine/spec/adaptive.py: measured step costs overrule the plan's yes/no, in both directions.

The controller is driven without a model: a stub engine (no acceptance statistics yet, so the
prior) and a fixed latency model in place of the calibration.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.simulator import LatencyModel
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
    arms = [CHAIN, MAX] if graphed else []
    eng = SimpleNamespace(
        acceptance=AcceptanceCounter(), graphed_budgets=lambda sampled: [] if sampled else arms
    )
    return eng, AdaptiveController(eng, MAX)  # type: ignore[arg-type]


def _drive(
    eng: SimpleNamespace,
    controller: AdaptiveController,
    spec: tuple[float, int],
    ar: tuple[float, int],
) -> list[TreeBudget]:
    """STEPS decode steps as ``LLMEngine.step`` runs them, each costing ``spec`` or ``ar``
    (seconds, tokens); a speculative step after 2+ AR steps catches the MTP modules up and is
    not observed, as in the engine. Returns the budgets chosen."""
    budgets: list[TreeBudget] = []
    ar_run = 0
    for _ in range(STEPS):
        budget = controller.choose(eng, BATCH)  # type: ignore[arg-type]
        budgets.append(budget)
        if budget.speculates:
            if ar_run < 2:
                controller.observe(BATCH, MAX, *spec)
            ar_run = 0
        else:
            controller.observe(BATCH, NO_SPEC, *ar)
            ar_run += 1
    return budgets


def test_measured_speculation_overrules_a_plan_that_says_ar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan says budget 0 (its eager latency model can be wrong), yet speculative steps
    measure 2x cheaper per token: the controller speculates with the configured tree, checking
    AR now and then."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_AR)
    budgets = _drive(eng, controller, spec=(0.02, 16), ar=(0.01, 4))  # 1.25 vs 2.5 ms per token
    assert controller._planner is not None and controller._planner.plan(BATCH).budget == 0
    speculated = [b for b in budgets if b.speculates]
    assert len(speculated) >= 0.85 * STEPS
    assert all(b == MAX for b in speculated)
    assert not all(b.speculates for b in budgets[100:]), "AR is still checked once measured"


def test_measured_ar_overrules_a_plan_that_says_speculate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan says speculate, yet speculative steps measure 2x costlier per token: mostly AR,
    still exploring speculation now and then."""
    eng, controller = _controller(monkeypatch, PLAN_SAYS_SPEC)
    budgets = _drive(eng, controller, spec=(0.04, 8), ar=(0.01, 4))  # 5 vs 2.5 ms per token
    assert controller._planner is not None and controller._planner.plan(BATCH).budget > 0
    speculated = sum(b.speculates for b in budgets)
    assert speculated <= 0.15 * STEPS
    assert any(b.speculates for b in budgets[100:]), "speculation is still explored once measured"


def test_a_buckets_own_costs_win_then_monotonicity_then_neighbours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Speculation measured to win at batch 16 wins at smaller batches; AR measured to win at
    batch 64 wins at larger ones; failing those, a neighbouring bucket stands in."""
    _, controller = _controller(monkeypatch, PLAN_SAYS_SPEC)
    for _ in range(2):  # batch 16 (bucket 5): speculation cheaper, but only 2 steps of each
        controller.observe(16, MAX, seconds=0.01, tokens=64)
        controller.observe(16, NO_SPEC, seconds=0.01, tokens=16)
    assert controller._measured_says_ar(4, False) is None  # fewer than 3 of each: not measured
    controller.observe(16, MAX, seconds=0.01, tokens=64)
    controller.observe(16, NO_SPEC, seconds=0.01, tokens=16)
    assert controller._measured_says_ar(16, False) is False  # 3 of each: its own costs decide
    assert controller._measured_says_ar(4, False) is False  # smaller batch: speculation too
    assert controller._measured_says_ar(64, False) is None  # larger, not a neighbour: unknown
    assert controller._measured_says_ar(32, False) is False  # the neighbouring bucket
    for _ in range(3):  # batch 64 (bucket 7): AR cheaper per token
        controller.observe(64, MAX, seconds=0.04, tokens=64)
        controller.observe(64, NO_SPEC, seconds=0.01, tokens=64)
    assert controller._measured_says_ar(64, False) is True
    assert controller._measured_says_ar(256, False) is True  # larger batch: AR too
    assert controller._measured_says_ar(32, False) is True  # between: the upper neighbour
    assert controller._measured_says_ar(4, True) is None  # sampled steps are apart
    for _ in range(3):  # batch 2 (bucket 2) measured AR cheaper, contradicting batch 16
        controller.observe(2, MAX, seconds=0.04, tokens=4)
        controller.observe(2, NO_SPEC, seconds=0.01, tokens=2)
    assert controller._measured_says_ar(2, False) is True  # its own costs
    assert controller._measured_says_ar(1, False) is False  # larger buckets' wins come first


def test_one_buckets_batch_sizes_share_one_planned_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches 2 and 3 keep their step costs in one bucket; planning them at different batch
    sizes gave different shapes there, and each change of shape threw the costs away."""
    latency = LatencyModel.analytic(verify_fixed=0.01, verify_per_token=1e-4)
    eng, controller = _controller(monkeypatch, latency)
    controller.choose(eng, 2)  # type: ignore[arg-type]
    assert controller._planner is not None
    assert controller._planner.plan(2).budget != controller._planner.plan(4).budget
    controller.observe(2, MAX, seconds=0.01, tokens=8)
    for batch in (3, 2, 3):
        controller.choose(eng, batch)  # type: ignore[arg-type]
        assert (2, False, True) in controller._steps


def test_graphed_path_chooses_among_the_captured_budgets_by_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With captured device steps the plan (eager forwards) is no guide: every arm is measured
    within a few steps whatever the plan says, and the cheapest per token carries the steps."""
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
    assert controller._steps == {}, "graphed steps are not counted on the host path's books"
