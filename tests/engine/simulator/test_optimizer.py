"""The optimiser: exact against brute force, never worse than fixed trees, budget choice."""

from __future__ import annotations

import numpy as np
import pytest

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import estimate, expected_length
from engine.simulator.latency import LatencyModel
from engine.simulator.optimizer import (
    SpeculationPlanner,
    TreeOptimizer,
    best_budget,
    greedy_tree,
    optimal_tree,
)
from engine.simulator.tree_shape import TreeShape, enumerate_shapes


def random_stats(rng: np.random.Generator, monotone: bool) -> AcceptanceStats:
    rows = []
    for _ in range(int(rng.integers(1, 4))):
        k = int(rng.integers(1, 5))
        probs = rng.dirichlet(np.ones(k + 1))[:k]  # the last share is "no child accepted"
        rows.append(tuple(float(p) for p in (sorted(probs, reverse=True) if monotone else probs)))
    return AcceptanceStats(tuple(rows))


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_brute_force_over_all_shapes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    stats = random_stats(rng, monotone=seed % 2 == 0)
    max_depth = None if seed < 4 else 2
    solver = TreeOptimizer(stats, 6)
    for n in range(7):
        brute = max(
            expected_length(s, stats)
            for size in range(n + 1)
            for s in enumerate_shapes(size, max_depth)
        )
        tree = solver.tree(n, max_depth)
        assert solver.best_value(n, max_depth) == pytest.approx(brute, abs=1e-12)
        assert expected_length(tree, stats) == pytest.approx(brute, abs=1e-12)
        assert tree.budget <= n
        assert max_depth is None or tree.max_depth <= max_depth


def test_enumeration_counts_ordered_forests() -> None:
    assert [len(enumerate_shapes(n)) for n in range(7)] == [1, 1, 2, 5, 14, 42, 132]


@pytest.mark.parametrize("seed", range(20))
def test_optimum_never_worse_than_chain_or_kary_trees(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    stats = random_stats(rng, monotone=bool(seed % 2))
    solver = TreeOptimizer(stats, 24)
    for n in (1, 3, 8, 15, 24):
        best = expected_length(solver.tree(n), stats)
        for k in (1, 2, 3, 4):
            assert best >= expected_length(TreeShape.kary(k, n), stats) - 1e-12


@pytest.mark.parametrize("seed", range(10))
def test_greedy_is_exact_on_rank_monotone_stats(seed: int) -> None:
    stats = random_stats(np.random.default_rng(200 + seed), monotone=True)
    assert stats.is_rank_monotone()
    for n in (1, 5, 12, 30):
        for depth in (None, 3):
            dp = expected_length(optimal_tree(stats, n, depth), stats)
            assert expected_length(greedy_tree(stats, n, depth), stats) == pytest.approx(dp)


def test_dp_beats_greedy_when_a_weak_rank_hides_a_strong_one() -> None:
    stats = AcceptanceStats(((0.3, 0.01, 0.6), (0.1,)))
    assert expected_length(greedy_tree(stats, 3), stats) == pytest.approx(1 + 0.3 + 0.03 + 0.01)
    dp = optimal_tree(stats, 3)
    assert dp.to_nested() == [[], [], []]
    assert expected_length(dp, stats) == pytest.approx(1.91)


def test_width_and_depth_limits_and_fewest_nodes() -> None:
    stats = AcceptanceStats(((0.5, 0.2, 0.1),))
    tree = optimal_tree(stats, 20, max_depth=2, max_width=2)
    assert tree.budget == 6  # 2 children at depth 1, 2 each at depth 2
    assert tree.max_children == 2 and tree.max_depth == 2
    zero = AcceptanceStats(((0.5, 0.0),))
    assert optimal_tree(zero, 5, max_depth=3) == TreeShape.chain(3)


def test_small_hand_optimum() -> None:
    # budget 2: chain gives 0.8 + 0.8*0.5 = 1.2; two children give 0.8 + 0.15 = 0.95
    stats = AcceptanceStats(((0.8, 0.15), (0.5, 0.1)))
    assert optimal_tree(stats, 2) == TreeShape.chain(2)
    # budget 3: chain of 3 adds 0.2; the rank-1 root child adds 0.15; rank-1 at depth 2: 0.08
    assert expected_length(optimal_tree(stats, 3), stats) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_best_budget_chooses_no_speculation_when_verify_is_token_bound() -> None:
    stats = AcceptanceStats.chain([0.5])
    lat = LatencyModel.analytic(0.0, 1.0)  # each verified token costs as much as a step
    plan = best_budget(stats, lat, batch_size=4, budgets=range(8))
    assert plan.budget == 0 and plan.speedup == pytest.approx(1.0)
    assert plan.widths_per_depth() == [] and plan.max_depth == 0 and plan.topk == 0


def test_best_budget_takes_the_largest_budget_when_tokens_are_free() -> None:
    stats = AcceptanceStats(((0.7, 0.2), (0.6, 0.2)))
    lat = LatencyModel.analytic(0.01, 0.0)
    plan = best_budget(stats, lat, batch_size=1, budgets=[0, 4, 8, 16])
    assert plan.budget == 16
    assert plan.expected_length == pytest.approx(expected_length(optimal_tree(stats, 16), stats))
    assert sum(plan.widths_per_depth()) == 16 and len(plan.widths_per_depth()) == plan.max_depth


@pytest.mark.parametrize("seed", range(6))
def test_planner_beats_every_fixed_tree_when_draft_cost_is_per_depth(seed: int) -> None:
    # with draft cost independent of width, the planner's search over (budget, depth) is exact
    rng = np.random.default_rng(300 + seed)
    stats = random_stats(rng, monotone=bool(seed % 2))
    lat = LatencyModel.analytic(0.02, 0.0004, 0.003, 0.0, step_overhead_seconds=0.001)
    planner = SpeculationPlanner(stats, lat, budgets=range(13))
    for b in (1, 8, 64):
        plan = planner.plan(b)
        for n in range(13):
            for k in (1, 2, 3):
                fixed = estimate(TreeShape.kary(k, n), stats, lat, b)
                assert plan.tokens_per_s >= fixed.tokens_per_s * (1 - 1e-12)


def test_best_budget_shrinks_as_batch_grows() -> None:
    stats = AcceptanceStats(((0.75, 0.1, 0.05), (0.7, 0.1)))
    lat = LatencyModel.analytic(0.02, 0.00005, 0.001, 0.000002)
    planner = SpeculationPlanner(stats, lat, budgets=range(33))
    budgets = [planner.plan(b).budget for b in (1, 16, 256)]
    assert budgets[0] > budgets[1] > budgets[2]
