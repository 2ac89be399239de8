"""Latency model of one decoding step: target verify and MTP draft times.

Terms:
  - ``verify_seconds(b, t)``: one target forward over ``b`` sequences with ``t`` new tokens each
    (``t = 1`` is a plain autoregressive decode step; a tree of ``N`` draft nodes has
    ``t = N + 1``, the root included).
  - ``draft_seconds(b, t)``: one MTP forward (one draft depth) over ``b`` sequences with ``t``
    tokens each (the nodes of the previous depth that get children).
  - ``step_overhead_seconds``: fixed host cost per speculative step (tree building, acceptance),
    added to every step that drafts; 0 unless measured.
  - ``depth_overhead_seconds``: host cost per drafted depth (building the depth's rows, growing
    the tree), added once per depth that drafts; 0 unless measured.
  - ``decode_overhead_seconds``: host cost of every decode step, autoregressive ones included
    (batch building, sampling, output bookkeeping); 0 unless measured.

Each surface is either measured points, interpolated piecewise-linearly (in tokens within each
measured batch size, then across batch sizes; linear extrapolation above the measured range,
constant below it), or the analytic ``fixed + per_token * b * t``.

JSON: ``{"verify": [{"batch_size": b, "tokens": t, "seconds": s}, ...],
"draft_per_depth": [...same...], "step_overhead_seconds": 0.0, "depth_overhead_seconds": 0.0,
"decode_overhead_seconds": 0.0}`` (the overheads optional); either list may instead be
``{"fixed": f, "per_token": c}``.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.simulator.json_file import read_json


class Surface(Protocol):
    """Seconds of one forward as a function of (batch size, tokens per sequence)."""

    def __call__(self, batch_size: int, tokens: int) -> float: ...

    def to_json_value(self) -> Any: ...


@dataclass(frozen=True)
class AffineSurface:
    """``fixed + per_token * batch_size * tokens`` seconds."""

    fixed: float
    per_token: float

    def __post_init__(self) -> None:
        for name in ("fixed", "per_token"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")

    def __call__(self, batch_size: int, tokens: int) -> float:
        return self.fixed + self.per_token * batch_size * tokens

    def to_json_value(self) -> Any:
        return {"fixed": self.fixed, "per_token": self.per_token}

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> AffineSurface:
        """Least-squares fit of ``fixed`` and ``per_token`` to ``(b, t, seconds)`` points."""
        if len(points) < 2:
            raise ValueError("an affine fit needs at least two measured points")
        xs = [float(b * t) for b, t, _ in points]
        ys = [float(s) for _, _, s in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        slope = max(slope, 0.0)
        return cls(max(my - slope * mx, 0.0), slope)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in ``x``; constant below ``xs[0]``, linear extrapolation above."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)  # above the range: extend the last segment
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class MeasuredSurface:
    """Measured ``(batch_size, tokens, seconds)`` points, interpolated piecewise-linearly."""

    points: tuple[tuple[int, int, float], ...]
    _rows: tuple[tuple[float, tuple[float, ...], tuple[float, ...]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a measured latency needs at least one point")
        seen: set[tuple[int, int]] = set()
        for b, t, s in self.points:
            if (b, t) in seen:
                raise ValueError(f"duplicate measurement for batch_size={b}, tokens={t}")
            seen.add((b, t))
            if not math.isfinite(s) or s <= 0:
                raise ValueError(f"batch_size={b}, tokens={t}: seconds must be positive, got {s}")
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for b, t, s in self.points:
            by_batch.setdefault(b, []).append((t, s))
        rows = tuple(
            (float(b), tuple(float(t) for t, _ in sorted(r)), tuple(s for _, s in sorted(r)))
            for b, r in sorted(by_batch.items())
        )
        object.__setattr__(self, "_rows", rows)

    def __call__(self, batch_size: int, tokens: int) -> float:
        batches = [b for b, _, _ in self._rows]
        per_batch = [_interp(ts, ss, float(tokens)) for _, ts, ss in self._rows]
        # never below the cheapest measurement: extrapolation must not predict free steps
        return max(_interp(batches, per_batch, float(batch_size)), min(s for *_, s in self.points))

    def to_json_value(self) -> Any:
        return [{"batch_size": b, "tokens": t, "seconds": s} for b, t, s in self.points]


def _surface(value: Any, name: str) -> Surface:
    if isinstance(value, Mapping):
        if set(value) != {"fixed", "per_token"}:
            raise ValueError(f"{name}: an analytic latency needs exactly 'fixed' and 'per_token'")
        return AffineSurface(value["fixed"], value["per_token"])
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of measured points or {{fixed, per_token}}")
    points = []
    for i, p in enumerate(value):
        if not isinstance(p, Mapping) or not {"batch_size", "tokens", "seconds"} <= set(p):
            raise ValueError(f"{name}[{i}] needs 'batch_size', 'tokens' and 'seconds'")
        b, t, s = p["batch_size"], p["tokens"], p["seconds"]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (b, t)):
            raise ValueError(f"{name}[{i}]: batch_size and tokens must be positive integers")
        if isinstance(s, bool) or not isinstance(s, int | float):
            raise ValueError(f"{name}[{i}]: seconds must be a number, got {s!r}")
        points.append((b, t, float(s)))
    try:
        return MeasuredSurface(tuple(points))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


@dataclass(frozen=True)
class LatencyModel:
    """Verify and draft step times as functions of batch size and tokens (module docstring)."""

    verify: Surface
    draft: Surface
    step_overhead_seconds: float = 0.0
    depth_overhead_seconds: float = 0.0
    decode_overhead_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_overhead_seconds", "depth_overhead_seconds", "decode_overhead_seconds"):
            o = getattr(self, name)
            if not isinstance(o, int | float) or not math.isfinite(o) or o < 0:
                raise ValueError(f"{name} must be a non-negative number, got {o!r}")

    def with_overheads(self, step: float, depth: float, decode: float) -> LatencyModel:
        """The same forward surfaces with measured host overheads."""
        return LatencyModel(self.verify, self.draft, step, depth, decode)

    def verify_seconds(self, batch_size: int, tokens: int) -> float:
        """One target forward: ``batch_size`` sequences of ``tokens`` new tokens each."""
        return self.verify(batch_size, tokens)

    def draft_seconds(self, batch_size: int, tokens: int) -> float:
        """One MTP draft depth: ``batch_size`` sequences of ``tokens`` expanded nodes each."""
        return self.draft(batch_size, tokens)

    @classmethod
    def analytic(
        cls,
        verify_fixed: float,
        verify_per_token: float,
        draft_fixed: float = 0.0,
        draft_per_token: float = 0.0,
        step_overhead_seconds: float = 0.0,
    ) -> LatencyModel:
        """The analytic fallback: each forward costs ``fixed + per_token * b * t``."""
        return cls(
            AffineSurface(verify_fixed, verify_per_token),
            AffineSurface(draft_fixed, draft_per_token),
            step_overhead_seconds,
        )

    @classmethod
    def fit(cls, measurements: Mapping[str, Any]) -> LatencyModel:
        """Build from a measurements dict (the JSON layout of the module docstring)."""
        if not isinstance(measurements, Mapping):
            raise ValueError("latency measurements must be a JSON object")
        for key in ("verify", "draft_per_depth"):
            if key not in measurements:
                raise ValueError(f"latency measurements need '{key}'")
        return cls(
            _surface(measurements["verify"], "verify"),
            _surface(measurements["draft_per_depth"], "draft_per_depth"),
            measurements.get("step_overhead_seconds", 0.0),
            measurements.get("depth_overhead_seconds", 0.0),
            measurements.get("decode_overhead_seconds", 0.0),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> LatencyModel:
        data = read_json(path)
        try:
            return cls.fit(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {
            "verify": self.verify.to_json_value(),
            "draft_per_depth": self.draft.to_json_value(),
            "step_overhead_seconds": self.step_overhead_seconds,
            "depth_overhead_seconds": self.depth_overhead_seconds,
            "decode_overhead_seconds": self.decode_overhead_seconds,
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
