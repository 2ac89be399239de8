"""engine/spec/catch_up_cost.py: a fixed part plus a part per row, fitted robustly."""

from __future__ import annotations

import pytest

from engine.spec.catch_up_cost import CatchUpCost

H200 = [(64, 0.0132), (1024, 0.0311), (4096, 0.0459), (16768, 0.1277)]  # measured, gpu preset


def test_nothing_measured_costs_nothing() -> None:
    assert CatchUpCost().seconds(1000) == 0.0


def test_two_sizes_give_the_line_through_them() -> None:
    cost = CatchUpCost()
    cost.calibrate([(64, 0.013), (1024, 0.031)])
    per_row = 0.018 / 960
    assert cost.seconds(64) == pytest.approx(0.013)
    assert cost.seconds(4096) == pytest.approx(0.013 + per_row * (4096 - 64))
    assert cost.seconds(0) == 0.0


def test_the_h200_catch_ups_are_predicted_where_a_cost_per_row_is_not() -> None:
    """Calibrated on 1, 16 and 64 prompts (as on a GPU), the fit predicts 256 prompts within 20%;
    one prompt's cost per row would put 16 prompts at 7x their cost."""
    cost = CatchUpCost()
    cost.calibrate(H200[:3])
    rows, seconds = H200[3]
    assert cost.seconds(rows) == pytest.approx(seconds, rel=0.2)
    for rows, seconds in H200[:3]:
        assert cost.seconds(rows) == pytest.approx(seconds, rel=0.35)
    per_row_of_one_prompt = H200[0][1] / H200[0][0]
    assert per_row_of_one_prompt * H200[1][0] > 6 * H200[1][1]


def test_one_stall_does_not_move_the_fit() -> None:
    cost = CatchUpCost()
    for rows, seconds in H200:
        cost.observe(rows, seconds)
    before = cost.seconds(2048)
    cost.observe(64, 0.5)  # a garbage collection inside a one-prompt catch-up
    assert cost.seconds(2048) == pytest.approx(before, rel=0.35)
    cost.observe(1024, 0.0)  # one timed short
    assert cost.seconds(2048) >= 0.5 * before


def test_one_size_is_proportional_at_the_lower_median_per_row() -> None:
    cost = CatchUpCost()
    for seconds in (0.004, 0.5, 0.005):  # 64 rows each; one stall
        cost.observe(64, seconds)
    assert cost.seconds(64) == pytest.approx(0.005)
    assert cost.seconds(128) == pytest.approx(0.010)


def test_calibration_points_stay_when_the_window_rolls() -> None:
    """Catch-ups of one size only (a server at one load) keep the calibrated line's slope."""
    cost = CatchUpCost(window=4)
    cost.calibrate([(64, 0.012), (1024, 0.030)])
    for _ in range(10):
        cost.observe(64, 0.012)
    assert cost.seconds(1024) == pytest.approx(0.030, rel=0.05)


def test_small_catch_ups_measured_in_steps_move_the_fixed_part_not_the_slope() -> None:
    """Calibrated over 1, 16 and 64 prompts, then catch-ups of a few hundred rows measured in
    steps, each ~1.5 ms dearer than the calibration's line (what the step adds). Their pairs
    had put the slope near 3 us per row and 8192 rows at 25 ms (session 38's sweep: 29 ms);
    the calibrated slope stays and the fixed part takes the extra."""
    fresh, cost = CatchUpCost(), CatchUpCost()
    for fit in (fresh, cost):
        fit.calibrate([(64, 0.0011), (1024, 0.0020), (4096, 0.0045)])
    line = fresh.seconds(8192)
    for rows, seconds in [(96, 0.0025), (192, 0.0030), (96, 0.0024), (192, 0.0028), (384, 0.0035),
                          (192, 0.0031), (48, 0.0022), (384, 0.0033)]:  # fmt: skip
        cost.observe(rows, seconds)
    assert line < cost.seconds(8192) < line + 0.002
    assert cost.seconds(8192) - cost.seconds(4096) == pytest.approx(line - fresh.seconds(4096))
