"""A latency model from a live engine's measured decode steps (adaptive speculation's arm costs).

Adaptive speculation measures what each of its arms (no speculation, the captured chain and
tree) costs per decode step in each batch-size bucket, host work included
(``engine.spec.arms.MeasuredArms``); an engine reports them in its acceptance snapshot
(``arm_costs``, on a server ``/admin/acceptance``). ``latency_from_arm_costs`` turns them into the
simulator's ``LatencyModel``, so that the optimiser weighs every tree shape with the step costs
the scheduler measured rather than with forwards timed apart from the serving loop.

Per batch size ``b`` (a bucket's mean sequences per step): the autoregressive step is
``verify(b, 1)``; a drafting arm of ``N`` draft nodes and depth ``D`` costs
``verify(b, 1) + beta * N + delta * D`` (``expected.step_seconds`` with ``verify(b, N + 1) =
verify(b, 1) + beta * N`` and ``delta`` per drafted depth), ``beta`` and ``delta`` fitted
non-negative by least squares over that batch size's drafting arms. Two drafting arms of
different shapes are reproduced exactly; with one, the verify is taken as flat in its tokens
(``beta = 0``, what a batch-1 GPU step shows). Batch sizes without an autoregressive measurement
give no points (the baseline is what the model is relative to).

Record (JSON): ``{"batch_size": rows, "sampled": bool, "arm": label, "topk": K, "depth": D,
"num_draft_tokens": N, "step_seconds": s, "tokens_per_seq": y, "steps": n}``; ``arm`` is
``none`` for autoregressive steps (depth and nodes 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.simulator.latency import LatencyModel, MeasuredSurface

MIN_SECONDS = 1e-9  # a fitted term that measured free (a measured surface needs positive times)


@dataclass(frozen=True)
class ArmCost:
    """One arm's measured decode step in one batch-size bucket."""

    batch_size: float
    sampled: bool
    arm: str
    depth: int
    num_draft_tokens: int
    step_seconds: float
    tokens_per_seq: float
    steps: int

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], where: str) -> ArmCost:
        try:
            cost = cls(
                float(record["batch_size"]), bool(record.get("sampled", False)), str(record["arm"]),
                int(record.get("depth", 0)), int(record.get("num_draft_tokens", 0)),
                float(record["step_seconds"]), float(record.get("tokens_per_seq", 1.0)),
                int(record.get("steps", 0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: an arm cost needs batch_size, arm and step_seconds ({exc})") from None
        if not (math.isfinite(cost.batch_size) and cost.batch_size > 0):
            raise ValueError(f"{where}: batch_size must be positive, got {cost.batch_size}")
        if not (math.isfinite(cost.step_seconds) and cost.step_seconds > 0):
            raise ValueError(f"{where}: step_seconds must be positive, got {cost.step_seconds}")
        if cost.depth < 0 or cost.num_draft_tokens < 0 or (cost.depth == 0) != (cost.num_draft_tokens == 0):
            raise ValueError(f"{where}: depth and num_draft_tokens must be both 0 (no speculation) or both positive")
        return cost

    @property
    def drafts(self) -> bool:
        return self.num_draft_tokens > 0


@dataclass(frozen=True)
class BatchFit:
    """The fitted step terms at one batch size: seconds of the autoregressive step, per verified
    draft token and per drafted depth."""

    batch_size: int
    autoregressive: float
    per_token: float
    per_depth: float

    def step_seconds(self, num_draft_tokens: int, depth: int) -> float:
        return self.autoregressive + self.per_token * num_draft_tokens + self.per_depth * depth


def load_arm_costs(data: Any, where: str = "arm costs") -> list[ArmCost]:
    """Records from a list, or from an object holding them under ``arm_costs`` (a snapshot)."""
    records = data.get("arm_costs") if isinstance(data, Mapping) else data
    if isinstance(records, str | bytes) or not isinstance(records, Sequence):
        raise ValueError(f"{where}: expected a list of arm costs or an object with 'arm_costs'")
    costs = []
    for i, r in enumerate(records):
        if not isinstance(r, Mapping):
            raise ValueError(f"{where}[{i}]: an arm cost must be an object")
        costs.append(ArmCost.from_dict(r, f"{where}[{i}]"))
    return costs


def _nonnegative_least_squares(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(beta, delta) >= 0 minimising sum (beta * N + delta * D - y)^2 over (N, D, y)."""

    def residual(beta: float, delta: float) -> float:
        return sum((beta * n + delta * d - y) ** 2 for n, d, y in points)

    snn = sum(n * n for n, _, _ in points)
    sdd = sum(d * d for _, d, _ in points)
    snd = sum(n * d for n, d, _ in points)
    sny = sum(n * y for n, _, y in points)
    sdy = sum(d * y for _, d, y in points)
    candidates = [(0.0, 0.0)]
    det = snn * sdd - snd * snd
    if len({(n, d) for n, d, _ in points}) > 1 and det > 1e-12 * max(snn * sdd, 1e-300):
        beta, delta = (sny * sdd - sdy * snd) / det, (sdy * snn - sny * snd) / det
        if beta >= 0 and delta >= 0:
            candidates.append((beta, delta))
    if sdd > 0:
        candidates.append((0.0, max(sdy / sdd, 0.0)))  # the verify flat in its tokens
    if snn > 0:
        candidates.append((max(sny / snn, 0.0), 0.0))
    return min(candidates, key=lambda c: (residual(*c), c[0]))


def fit_arm_costs(costs: Sequence[ArmCost], sampled: bool = False) -> list[BatchFit]:
    """Per batch size with an autoregressive measurement, its fitted step terms (module
    docstring); ``sampled`` picks the sampled batches' arms."""
    by_batch: dict[int, list[ArmCost]] = {}
    for c in costs:
        if c.sampled == sampled:
            by_batch.setdefault(max(round(c.batch_size), 1), []).append(c)
    fits = []
    for b, arms in sorted(by_batch.items()):
        base = [c for c in arms if not c.drafts]
        if not base:
            continue
        ar = base[0].step_seconds
        points = [(c.num_draft_tokens, c.depth, c.step_seconds - ar) for c in arms if c.drafts]
        beta, delta = _nonnegative_least_squares(points) if points else (0.0, 0.0)
        fits.append(BatchFit(b, ar, beta, delta))
    if not fits:
        kind = "sampled" if sampled else "greedy"
        raise ValueError(f"no {kind} batch size has an autoregressive step measured: nothing to fit")
    return fits


def latency_from_arm_costs(costs: Sequence[ArmCost], sampled: bool = False) -> LatencyModel:
    """The simulator's latency model from measured arm costs (module docstring)."""
    fits = fit_arm_costs(costs, sampled)
    widest = max((c.num_draft_tokens for c in costs if c.sampled == sampled), default=0)
    verify: list[tuple[int, int, float]] = []
    draft: list[tuple[int, int, float]] = []
    for f in fits:
        verify.append((f.batch_size, 1, f.autoregressive))
        if widest and f.per_token > 0:
            verify.append((f.batch_size, widest + 1, f.autoregressive + f.per_token * widest))
        draft.append((f.batch_size, 1, max(f.per_depth, MIN_SECONDS)))
    return LatencyModel(MeasuredSurface(tuple(verify)), MeasuredSurface(tuple(draft)))


def format_arm_costs(costs: Sequence[ArmCost], fits: Sequence[BatchFit], sampled: bool = False) -> str:
    """The measured arms next to the fitted model's step time, per batch size."""
    by_batch = {f.batch_size: f for f in fits}
    lines = [
        f"measured arm costs ({'sampled' if sampled else 'greedy'}; model: ar + per token x N + per depth x D)",
        f"{'batch':>5}  {'arm':<14} {'steps':>6} {'step ms':>9} {'model ms':>9} {'tokens/seq':>10}",
    ]
    for c in sorted((c for c in costs if c.sampled == sampled), key=lambda c: (c.batch_size, c.num_draft_tokens)):
        fit = by_batch.get(max(round(c.batch_size), 1))
        model = f"{fit.step_seconds(c.num_draft_tokens, c.depth) * 1e3:9.3f}" if fit else f"{'-':>9}"
        lines.append(f"{c.batch_size:5.1f}  {c.arm:<14} {c.steps:6d} {c.step_seconds * 1e3:9.3f} {model} "
                     f"{c.tokens_per_seq:10.2f}")  # fmt: skip
    lines.append("fitted per batch size: " + "; ".join(
        f"b={f.batch_size}: ar {f.autoregressive * 1e3:.3f} ms, {f.per_token * 1e6:.1f} us/token, "
        f"{f.per_depth * 1e3:.3f} ms/depth" for f in fits))  # fmt: skip
    return "\n".join(lines)
