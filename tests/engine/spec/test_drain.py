"""engine/spec/drain.py: what a closed batch's uneven finish under drafting costs."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from engine.spec.drain import (
    MIN_DRAFT_STEPS,
    MIN_SPREAD,
    QUANTILES,
    YieldSpread,
    closed_batch_seconds,
)


def _linear(fixed: float, per_seq: float):  # type: ignore[no-untyped-def]
    return lambda alive: fixed + per_seq * alive


def test_equal_yields_cost_the_steady_steps() -> None:
    step = _linear(1.0, 0.5)
    assert closed_batch_seconds(step, 8, 10.0, [1.0]) == pytest.approx(10 * step(8))
    assert closed_batch_seconds(step, 8, 10.0, [1.0] * 16) == pytest.approx(10 * step(8))


def test_two_sequences_of_two_yields_by_hand() -> None:
    """Needs 4 and 8 steps (relative yields 1 and 0.5), step = 1 + alive. Both draws equal:
    4 x 3 or 8 x 3; mixed (two of four cases): 4 x 3 + 4 x 2. Mean (12 + 24 + 2 x 20) / 4 = 19,
    exactly what the formula gives for a linear step."""
    assert closed_batch_seconds(_linear(1.0, 1.0), 2, 4.0, [1.0, 0.5]) == pytest.approx(19.0)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_expected_cost_over_all_draws_of_the_batch(batch: int) -> None:
    """Exact enumeration of every assignment of three relative yields to the batch's sequences,
    with a linear step (where the mean alive count given some alive is exact)."""
    yields, steps, step = [0.6, 1.0, 1.5], 12.0, _linear(2.0, 0.7)
    total = 0.0
    for draw in itertools.product(yields, repeat=batch):
        needs = sorted(steps / r for r in draw)
        seconds, previous = 0.0, 0.0
        for i, need in enumerate(needs):
            seconds += (need - previous) * step(batch - i)
            previous = need
        total += seconds
    expected = total / len(yields) ** batch
    assert closed_batch_seconds(step, batch, steps, yields) == pytest.approx(expected)


def test_a_spread_costs_more_than_the_steady_steps_and_grows_with_the_batch() -> None:
    """The batch finishes with its hardest sequence: the wider the spread, the dearer, and at a
    larger batch the hardest draw is harder (Monte Carlo over sequences drawn from the spread)."""
    step = _linear(2.0, 0.1)
    narrow, wide = [0.9, 1.0, 1.1], [0.5, 1.0, 1.5]
    steady = 20 * step(64)
    assert steady < closed_batch_seconds(step, 64, 20.0, narrow) < closed_batch_seconds(step, 64, 20.0, wide)
    rng = random.Random(0)
    for batch in (4, 64):
        draws = []
        for _ in range(400):
            needs = sorted(20.0 / rng.choice(wide) for _ in range(batch))
            seconds = previous = 0.0
            for i, need in enumerate(needs):
                seconds += (need - previous) * step(batch - i)
                previous = need
            draws.append(seconds)
        model = closed_batch_seconds(step, batch, 20.0, wide)
        assert model == pytest.approx(statistics.mean(draws), rel=0.03), batch


def test_the_spread_keeps_sequences_that_drafted_enough_shrunk_toward_the_mean() -> None:
    spread = YieldSpread()
    spread.observe(30.0, 10.0, MIN_DRAFT_STEPS - 1)  # too few drafting steps: left out
    assert len(spread) == 0 and not spread.ready
    spread.observe(20.0, 40.0, 8)  # half the mean yield, 8 steps: two pseudo-steps of the mean
    assert spread.quantiles()[0] == pytest.approx((20 + 10) / (40 + 10))
    for i in range(MIN_SPREAD - 1):
        spread.observe(40.0 + i, 40.0, 8)
    assert spread.ready
    q = spread.quantiles()
    assert len(q) == QUANTILES and q == sorted(q) and q[0] == pytest.approx(0.6)


def test_an_offline_runs_spread_is_each_sequence_against_the_mean_of_all() -> None:
    """Sequences of 30 and 10 tokens in 10 drafting steps each: the mean yield is 2, so each
    expected 20 tokens; shrunk by two pseudo-steps of the mean (4 tokens) they are 34/24 and
    14/24. A sequence without a drafting step is left out."""
    from engine.spec.drain import relative_yields

    got = relative_yields([(30, 10), (10, 10), (5, 0)])
    assert len(got) == QUANTILES
    assert sorted(set(got)) == pytest.approx([14 / 24, 34 / 24])
    assert relative_yields([(5, 0)]) == []
