"""Prediction error of the simulator against measured runs.

A *measured run* is one engine configuration (a tree shape at a batch size) whose mean accepted
length (``SpecStats.mean_accepted_length``) and, optionally, speedup over autoregressive decoding
were measured, e.g. on the demo model on CPU or the gpu model on an H200. The *relative error* of
a prediction is ``(predicted - measured) / measured``: positive when the model is optimistic.

JSON (a list): ``[{"name": "chain4", "tree": "chain:4" | {"parents": [...], "ranks": [...]},
"batch_size": 1, "mean_accepted_length": 2.9, "speedup": 1.8}, ...]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import estimate, expected_length
from engine.simulator.json_file import read_json
from engine.simulator.latency import LatencyModel
from engine.simulator.tree_shape import TreeShape


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``."""
    if measured <= 0 or not math.isfinite(measured):
        raise ValueError(f"a measured figure must be positive, got {measured!r}")
    return (predicted - measured) / measured


@dataclass(frozen=True)
class MeasuredRun:
    """Measured figures of one tree shape at one batch size."""

    name: str
    shape: TreeShape
    batch_size: int
    mean_accepted_length: float
    speedup: float | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasuredRun:
        if not isinstance(data, Mapping):
            raise ValueError("a measured run must be a JSON object")
        for key in ("tree", "mean_accepted_length"):
            if key not in data:
                raise ValueError(f"a measured run needs '{key}'")
        tree = data["tree"]
        shape = TreeShape.parse(tree) if isinstance(tree, str) else TreeShape.from_dict(tree)
        speedup = data.get("speedup")
        return cls(
            name=str(data.get("name", tree if isinstance(tree, str) else "tree")),
            shape=shape,
            batch_size=int(data.get("batch_size", 1)),
            mean_accepted_length=float(data["mean_accepted_length"]),
            speedup=None if speedup is None else float(speedup),
        )


def load_measured_runs(path: str | Path) -> list[MeasuredRun]:
    """Read a JSON list of measured runs (module docstring)."""
    data = read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: measured runs must be a JSON list")
    try:
        return [MeasuredRun.from_dict(item) for item in data]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class PredictionError:
    """Predicted against measured figures of one run."""

    run: MeasuredRun
    predicted_length: float
    predicted_speedup: float | None

    @property
    def length_error(self) -> float:
        return relative_error(self.predicted_length, self.run.mean_accepted_length)

    @property
    def speedup_error(self) -> float | None:
        if self.predicted_speedup is None or self.run.speedup is None:
            return None
        return relative_error(self.predicted_speedup, self.run.speedup)


@dataclass(frozen=True)
class ValidationReport:
    rows: tuple[PredictionError, ...]

    @property
    def mean_abs_length_error(self) -> float:
        return sum(abs(r.length_error) for r in self.rows) / len(self.rows)

    @property
    def max_abs_length_error(self) -> float:
        return max(abs(r.length_error) for r in self.rows)

    @property
    def mean_abs_speedup_error(self) -> float | None:
        errs = [abs(e) for r in self.rows if (e := r.speedup_error) is not None]
        return sum(errs) / len(errs) if errs else None

    def format(self) -> str:
        lines = [
            f"{'run':<16}{'batch':>6}{'len pred':>10}{'len meas':>10}{'err':>8}"
            f"{'spd pred':>10}{'spd meas':>10}{'err':>8}"
        ]
        for r in self.rows:
            sp = "-" if r.predicted_speedup is None else f"{r.predicted_speedup:.3f}"
            sm = "-" if r.run.speedup is None else f"{r.run.speedup:.3f}"
            se = "-" if (e := r.speedup_error) is None else f"{e:+.1%}"
            lines.append(
                f"{r.run.name[:15]:<16}{r.run.batch_size:>6}{r.predicted_length:>10.3f}"
                f"{r.run.mean_accepted_length:>10.3f}{r.length_error:>+8.1%}{sp:>10}{sm:>10}{se:>8}"
            )
        lines.append(
            f"mean |error|: length {self.mean_abs_length_error:.1%} "
            f"(max {self.max_abs_length_error:.1%})"
        )
        if (mean_speed := self.mean_abs_speedup_error) is not None:
            lines.append(f"mean |error|: speedup {mean_speed:.1%}")
        return "\n".join(lines)


def prediction_errors(
    stats: AcceptanceStats,
    latency: LatencyModel | None,
    runs: Sequence[MeasuredRun],
) -> ValidationReport:
    """Compare the model's predictions with measured runs (speedups need ``latency``)."""
    if not runs:
        raise ValueError("no measured runs to compare with")
    rows = []
    for run in runs:
        if latency is None:
            rows.append(PredictionError(run, expected_length(run.shape, stats), None))
        else:
            est = estimate(run.shape, stats, latency, run.batch_size)
            rows.append(PredictionError(run, est.expected_length, est.speedup))
    return ValidationReport(tuple(rows))
