"""Learning-rate schedule: warm-up in steps, cosine over steps or over the time budget."""

from __future__ import annotations

import pytest

from train.schedule import PhasePlan


def test_step_schedule_warms_up_then_decays_to_the_minimum() -> None:
    plan = PhasePlan("joint", peak_lr=1.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=100)
    assert plan.lr(0, 0.0) == pytest.approx(0.1, rel=0.01)
    assert 0.95 < plan.lr(9, 0.0) <= 1.0  # warm-up done, the cosine barely started
    assert plan.lr(50, 0.0) == pytest.approx(0.55, rel=0.01)
    assert plan.lr(100, 0.0) == pytest.approx(0.1)
    lrs = [plan.lr(s, 0.0) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_time_schedule_ends_when_the_time_is_spent_whatever_the_step() -> None:
    plan = PhasePlan("joint", peak_lr=1.0, min_lr_ratio=0.1, warmup_steps=1, time_s=60.0)
    assert plan.progress(5, 30.0) == pytest.approx(0.5)
    assert plan.lr(5, 30.0) == pytest.approx(0.55)
    assert plan.progress(5, 60.0) >= 1.0 and plan.lr(5, 60.0) == pytest.approx(0.1)
    both = PhasePlan("joint", 1.0, 0.1, 1, max_steps=10, time_s=60.0)
    assert both.progress(10, 1.0) == 1.0 and both.progress(1, 60.0) == 1.0


def test_a_phase_needs_a_length() -> None:
    with pytest.raises(ValueError, match="max_steps or time_s"):
        PhasePlan("joint", 1.0, 0.1, 1)
