"""Closed-form expectations on small hand-computed trees."""

from __future__ import annotations

import pytest

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import (
    closed_batch_estimate,
    estimate,
    expected_accepted_per_position,
    expected_length,
    step_seconds,
)
from engine.simulator.latency import LatencyModel
from engine.simulator.tree_shape import TreeShape


def test_chain_of_two() -> None:
    stats = AcceptanceStats.chain([0.8, 0.5])
    assert expected_length(TreeShape.chain(2), stats) == pytest.approx(1 + 0.8 + 0.4)


def test_root_with_two_ranked_children() -> None:
    stats = AcceptanceStats(((0.6, 0.2),))
    assert expected_length(TreeShape.kary(2, 2), stats) == pytest.approx(1.8)


def test_mixed_tree_and_per_position_rates() -> None:
    # root -> a (r0), b (r1); a -> c (r0), d (r1); c -> e (r0); depth 3 reuses depth 2's row
    stats = AcceptanceStats(((0.6, 0.2), (0.5, 0.3)))
    shape = TreeShape.from_nested([[[[]], []], []])
    a, b = 0.6, 0.2
    c, d = a * 0.5, a * 0.3
    e = c * 0.5
    assert expected_length(shape, stats) == pytest.approx(1 + a + b + c + d + e)
    assert expected_accepted_per_position(shape, stats) == pytest.approx([a + b, c + d, e])


def test_throughput_and_speedup_with_the_analytic_latency() -> None:
    stats = AcceptanceStats.chain([0.8, 0.5])
    lat = LatencyModel.analytic(0.010, 0.001, 0.002, 0.0005, step_overhead_seconds=0.001)
    shape = TreeShape.chain(2)
    b = 4
    # verify 3 tokens + two draft depths of 1 token each + overhead
    seconds = (0.010 + 0.001 * b * 3) + 2 * (0.002 + 0.0005 * b) + 0.001
    assert step_seconds(shape, lat, b) == pytest.approx(seconds)
    est = estimate(shape, stats, lat, b)
    assert est.tokens_per_s == pytest.approx(b * 2.2 / seconds)
    assert est.ar_tokens_per_s == pytest.approx(b / (0.010 + 0.001 * b))
    assert est.speedup == pytest.approx((2.2 / seconds) * (0.010 + 0.001 * b))


def test_draft_cost_counts_the_expanded_nodes_per_depth() -> None:
    lat = LatencyModel.analytic(1.0, 0.0, 0.0, 1.0)
    shape = TreeShape.from_nested([[[], []], [[]], []])  # depth 0: 1 expanded, depth 1: 2
    assert shape.expanded_per_depth() == [1, 2]
    assert step_seconds(shape, lat, 1) == pytest.approx(1.0 + 1 + 2)


def test_no_speculation_is_the_autoregressive_baseline() -> None:
    stats = AcceptanceStats.chain([0.9])
    lat = LatencyModel.analytic(0.01, 0.001, 0.5, 0.5, step_overhead_seconds=1.0)
    est = estimate(TreeShape.root_only(), stats, lat, 8)
    assert est.expected_length == 1.0
    assert est.speedup == pytest.approx(1.0)


def test_host_overheads_per_decode_step_and_per_drafted_depth() -> None:
    """Measured host costs: every decode step (AR too) pays ``decode``; a speculative step also
    pays ``step`` once and ``depth`` per depth that drafts."""
    stats = AcceptanceStats.chain([0.8, 0.5])
    base = LatencyModel.analytic(0.010, 0.001, 0.002, 0.0005)
    lat = base.with_overheads(step=0.001, depth=0.0003, decode=0.002)
    b = 2
    shape = TreeShape.chain(2)
    forwards = (0.010 + 0.001 * b * 3) + 2 * (0.002 + 0.0005 * b)
    assert step_seconds(shape, lat, b) == pytest.approx(forwards + 0.001 + 2 * 0.0003 + 0.002)
    assert step_seconds(TreeShape.root_only(), lat, b) == pytest.approx(0.010 + 0.001 * b + 0.002)
    est = estimate(shape, stats, lat, b)
    assert est.ar_tokens_per_s == pytest.approx(b / (0.010 + 0.001 * b + 0.002))
    assert est.speedup == pytest.approx(2.2 * (0.012 + 0.002) / (forwards + 0.001 + 0.0006 + 0.002))


def test_a_closed_batch_of_equal_yields_is_the_steady_estimate() -> None:
    stats = AcceptanceStats.chain([0.8, 0.5])
    lat = LatencyModel.analytic(0.010, 0.001, 0.002, 0.0005, step_overhead_seconds=0.001)
    shape = TreeShape.chain(2)
    steady = estimate(shape, stats, lat, 16)
    closed = closed_batch_estimate(shape, stats, lat, 16, 64, [1.0, 1.0])
    assert closed.speedup == pytest.approx(steady.speedup)
    assert closed.step_seconds == pytest.approx(steady.step_seconds)


def test_a_closed_batch_of_one_sequence_pays_its_mean_inverse_yield() -> None:
    """One sequence of relative yield 0.5 or 1.5 needs 2 or 2/3 of the mean's steps: on average
    4/3 of them, at the batch-1 step."""
    stats = AcceptanceStats.chain([0.8, 0.5])
    lat = LatencyModel.analytic(0.010, 0.001, 0.002, 0.0005)
    shape = TreeShape.chain(2)
    steady = estimate(shape, stats, lat, 1)
    closed = closed_batch_estimate(shape, stats, lat, 1, 64, [0.5, 1.5])
    assert closed.speedup == pytest.approx(steady.speedup * 3 / 4)


def test_a_latency_bound_closed_batch_waits_for_its_hardest_sequence() -> None:
    """Steps whose cost does not grow with the batch (a GPU's latency-bound regime): the
    closed batch costs the expected most steps any of its sequences needs. One sequence: the
    mean of 1/r over the spread; a large batch almost surely draws the hardest (r = 0.4)."""
    stats = AcceptanceStats.chain([0.9, 0.8, 0.7, 0.6])
    lat = LatencyModel.analytic(0.002, 0.0, 0.0003, 0.0)
    shape = TreeShape.chain(4)
    spread = [0.4, 0.7, 1.0, 1.3, 1.6]
    loss = [closed_batch_estimate(shape, stats, lat, b, 64, spread).speedup
            / estimate(shape, stats, lat, b).speedup for b in (1, 4, 16, 64, 256)]  # fmt: skip
    assert loss[0] == pytest.approx(1 / (sum(1 / r for r in spread) / len(spread)))
    assert loss == sorted(loss, reverse=True)
    assert loss[-1] == pytest.approx(0.4, rel=1e-6)


@pytest.mark.parametrize("spread", [[], [1.0, 0.0], [-1.0]])
def test_a_closed_batch_needs_positive_relative_yields(spread: list[float]) -> None:
    with pytest.raises(ValueError, match="relative_yields"):
        closed_batch_estimate(TreeShape.chain(1), AcceptanceStats.chain([0.5]),
                              LatencyModel.analytic(0.01, 0.0), 1, 8, spread)  # fmt: skip
