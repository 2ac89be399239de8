"""Prediction error against measured figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.latency import LatencyModel
from engine.simulator.validation import load_measured_runs, prediction_errors, relative_error


def test_relative_errors_of_length_and_speedup(tmp_path: Path) -> None:
    stats = AcceptanceStats.chain([0.8, 0.5])
    lat = LatencyModel.analytic(0.01, 0.0)  # drafting free: speedup = expected length
    path = tmp_path / "runs.json"
    path.write_text(
        json.dumps(
            [
                {"name": "c2", "tree": "chain:2", "mean_accepted_length": 2.0, "speedup": 2.4},
                {"tree": {"parents": [-1, 0]}, "mean_accepted_length": 1.6, "batch_size": 4},
            ]
        )
    )
    report = prediction_errors(stats, lat, load_measured_runs(path))
    first, second = report.rows
    assert first.predicted_length == pytest.approx(2.2)
    assert first.length_error == pytest.approx(0.1)
    assert first.speedup_error == pytest.approx((2.2 - 2.4) / 2.4)
    assert second.length_error == pytest.approx(0.2 / 1.6)
    assert second.speedup_error is None
    assert report.mean_abs_length_error == pytest.approx((0.1 + 0.125) / 2)
    assert report.mean_abs_speedup_error == pytest.approx(0.2 / 2.4)
    assert "(max 12.5%)" in report.format()


def test_bad_measurements_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        relative_error(1.0, 0.0)
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([{"tree": "chain:2"}]))
    with pytest.raises(ValueError, match="needs 'mean_accepted_length'"):
        load_measured_runs(path)
