"""LatencyModel: analytic fallback, measured interpolation, JSON validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.simulator.latency import AffineSurface, LatencyModel

EXAMPLES = Path(__file__).parents[3] / "engine" / "simulator" / "examples"


def test_analytic_model() -> None:
    lat = LatencyModel.analytic(0.01, 0.001, 0.002, 0.0001, step_overhead_seconds=0.0005)
    assert lat.verify_seconds(4, 3) == pytest.approx(0.01 + 0.012)
    assert lat.draft_seconds(2, 5) == pytest.approx(0.002 + 0.001)


def test_measured_points_interpolate_piecewise_linearly() -> None:
    lat = LatencyModel.fit(
        {
            "verify": [
                {"batch_size": 1, "tokens": 1, "seconds": 1.0},
                {"batch_size": 1, "tokens": 5, "seconds": 2.0},
                {"batch_size": 3, "tokens": 1, "seconds": 3.0},
                {"batch_size": 3, "tokens": 5, "seconds": 6.0},
            ],
            "draft_per_depth": {"fixed": 0.1, "per_token": 0.0},
        }
    )
    assert lat.verify_seconds(1, 5) == 2.0  # a measured point
    assert lat.verify_seconds(1, 3) == pytest.approx(1.5)  # between tokens
    assert lat.verify_seconds(2, 3) == pytest.approx((1.5 + 4.5) / 2)  # between batch sizes
    assert lat.verify_seconds(1, 9) == pytest.approx(3.0)  # last segment extended
    assert lat.verify_seconds(5, 1) == pytest.approx(5.0)  # last batch segment extended
    assert lat.draft_seconds(7, 7) == pytest.approx(0.1)


def test_json_round_trip_of_the_example(tmp_path: Path) -> None:
    lat = LatencyModel.from_json(EXAMPLES / "latency_example.json")
    lat.to_json(tmp_path / "lat.json")
    again = LatencyModel.from_json(tmp_path / "lat.json")
    assert again.verify_seconds(8, 7) == lat.verify_seconds(8, 7)
    assert again.step_overhead_seconds == lat.step_overhead_seconds


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"verify": []}, "need 'draft_per_depth'"),
        ({"verify": [], "draft_per_depth": []}, "verify: a measured latency needs at least one"),
        (
            {"verify": [{"batch_size": 1, "tokens": 1}], "draft_per_depth": []},
            r"verify\[0\] needs 'batch_size', 'tokens' and 'seconds'",
        ),
        (
            {
                "verify": [{"batch_size": 0, "tokens": 1, "seconds": 1}],
                "draft_per_depth": [],
            },
            "positive integers",
        ),
        (
            {
                "verify": [{"batch_size": 1, "tokens": 1, "seconds": -1}],
                "draft_per_depth": [],
            },
            "seconds must be positive",
        ),
        ({"verify": {"fixed": 1}, "draft_per_depth": []}, "exactly 'fixed' and 'per_token'"),
    ],
)
def test_invalid_latency_names_the_problem(tmp_path: Path, payload: object, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=message):
        LatencyModel.from_json(path)


def test_affine_fit_recovers_the_parameters() -> None:
    points = [(b, t, 0.02 + 0.001 * b * t) for b in (1, 2, 8) for t in (1, 4, 9)]
    fit = AffineSurface.fit(points)
    assert fit.fixed == pytest.approx(0.02)
    assert fit.per_token == pytest.approx(0.001)


def test_host_overheads_round_trip_and_validation(tmp_path: Path) -> None:
    lat = LatencyModel.analytic(0.01, 0.001).with_overheads(step=0.001, depth=0.0002, decode=0.003)
    lat.to_json(tmp_path / "lat.json")
    again = LatencyModel.from_json(tmp_path / "lat.json")
    assert (again.step_overhead_seconds, again.depth_overhead_seconds, again.decode_overhead_seconds) == (
        0.001, 0.0002, 0.003)
    with pytest.raises(ValueError, match="depth_overhead_seconds"):
        LatencyModel.analytic(0.01, 0.001).with_overheads(step=0.0, depth=-1.0, decode=0.0)
