"""The closed form agrees with simulated i.i.d. acceptance."""

from __future__ import annotations

import pytest

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import expected_accepted_per_position, expected_length
from engine.simulator.montecarlo import simulate
from engine.simulator.optimizer import optimal_tree
from engine.simulator.tree_shape import TreeShape

STATS = AcceptanceStats(((0.7, 0.15, 0.05), (0.6, 0.2), (0.5, 0.1, 0.1)))


@pytest.mark.parametrize(
    "shape",
    [
        TreeShape.chain(5),
        TreeShape.kary(2, 10),
        TreeShape.kary(3, 12),
        TreeShape.from_nested([[[[]], []], [[]], []]),
        optimal_tree(STATS, 16),
    ],
    ids=["chain5", "binary10", "ternary12", "mixed", "optimal16"],
)
def test_monte_carlo_matches_the_expectation(shape: TreeShape) -> None:
    result = simulate(shape, STATS, num_steps=200_000, seed=1)
    expected = expected_length(shape, STATS)
    assert abs(result.mean_length - expected) < 4 * result.std_error + 1e-9
    assert result.accepted_per_position == pytest.approx(
        expected_accepted_per_position(shape, STATS), abs=0.006
    )


def test_certain_acceptance_always_reaches_the_leaf() -> None:
    result = simulate(TreeShape.chain(4), AcceptanceStats.chain([1.0]), num_steps=100)
    assert result.mean_length == 5.0 and result.std_error == 0.0
