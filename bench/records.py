"""Turn timed batches into the result records of ``runs`` (one per mode x batch x temperature).

Every record has the same keys, so a reader never needs to test for presence; a point that did
not run has ``skipped`` set to the reason and ``None`` figures. Speedup over autoregressive is
paired: at each repeat the mode's tokens/s is divided by the ``ar`` tokens/s measured in the
same round (modes alternate within a round), and the median of those ratios is reported. This
cancels slow drifts of a shared machine's load.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.engine_run import BatchRun
from bench.stats import summarize

FIELDS = (
    "mode", "label", "batch_size", "temperature", "tokens_per_s", "tokens_per_s_min",
    "tokens_per_s_max", "tpot_ms", "tpot_ms_min", "tpot_ms_max", "ttft_ms", "step_ms",
    "draft_ms_per_step", "verify_ms_per_step", "rollback_ms_per_step", "mean_accepted_length",
    "acceptance_per_position", "draft_tokens_per_step", "speedup_vs_ar", "speedup_vs_ar_min",
    "speedup_vs_ar_max", "greedy_match", "repeats", "output_tokens", "floor", "step_over_floor",
    "cost_per_million_tokens", "saving_vs_ar", "steps_per_arm", "arm_costs", "fill_costs",
    "fill_questions", "skipped", "stalls", "warmup_stalls", "round_ms", "round_speedups",
)


def empty_record(mode: str, label: str, batch_size: int, temperature: float,
                 skipped: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(mode=mode, label=label, batch_size=batch_size, temperature=temperature,
               skipped=skipped, repeats=0)
    return rec


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def make_record(mode: str, label: str, batch_size: int, temperature: float,
                runs: list[BatchRun]) -> dict[str, Any]:
    """Median and spread over the repeats; speculation statistics summed over them."""
    rec = empty_record(mode, label, batch_size, temperature)
    tps = summarize([r.output_tokens / r.wall_s for r in runs])
    tpot = summarize([statistics.median(r.tpot_s) for r in runs])
    rec.update(
        tokens_per_s=tps["median"], tokens_per_s_min=tps["min"], tokens_per_s_max=tps["max"],
        tpot_ms=_ms(tpot["median"]), tpot_ms_min=_ms(tpot["min"]), tpot_ms_max=_ms(tpot["max"]),
        ttft_ms=_ms(statistics.median(statistics.median(r.ttft_s) for r in runs)),
        repeats=len(runs), output_tokens=runs[0].output_tokens,
        round_ms=[round(r.wall_s * 1e3, 2) for r in runs],  # each timed round's wall time, in order
    )
    arms: dict[str, int] = {}
    for r in runs:
        for label, n in r.steps_per_arm.items():
            arms[label] = arms.get(label, 0) + n
    rec["steps_per_arm"] = arms or None
    rec["arm_costs"] = runs[-1].arm_costs or None  # the adaptive engine's, after the last round
    rec["fill_costs"] = runs[-1].fill_costs or None
    rec["fill_questions"] = runs[-1].fill_questions or None  # the last round's
    decode = [r for r in runs if r.decode_steps]
    if decode:
        rec["step_ms"] = _ms(statistics.median(r.decode_s / r.decode_steps for r in decode))
    spec_steps = sum(r.spec_steps for r in runs)
    if spec_steps:
        rec["draft_ms_per_step"] = _ms(sum(r.draft_s for r in runs) / spec_steps)
        rec["verify_ms_per_step"] = _ms(sum(r.verify_s for r in runs) / spec_steps)
        rec["rollback_ms_per_step"] = _ms(sum(r.rollback_s for r in runs) / spec_steps)
    elif mode == "ar":
        rec["rollback_ms_per_step"] = 0.0
    steps = sum(r.num_steps for r in runs)
    if steps:
        accepted = sum(r.num_accepted_tokens for r in runs)
        rec["mean_accepted_length"] = 1.0 + accepted / steps
        rec["draft_tokens_per_step"] = sum(r.num_draft_tokens for r in runs) / steps
        depth = max(len(r.accepted_per_position) for r in runs)
        per = [sum(r.accepted_per_position[d] for r in runs if d < len(r.accepted_per_position))
               for d in range(depth)]
        rec["acceptance_per_position"] = [c / steps for c in per]
    return rec


def add_speedups(record: dict[str, Any], runs: list[BatchRun], ar_runs: list[BatchRun]) -> None:
    """Paired speedup over ``ar``: per-round tokens/s ratio, median and spread."""
    ratios = [(r.output_tokens / r.wall_s) / (a.output_tokens / a.wall_s)
              for r, a in zip(runs, ar_runs, strict=False)]
    s = summarize(ratios)
    record.update(speedup_vs_ar=s["median"], speedup_vs_ar_min=s["min"], speedup_vs_ar_max=s["max"],
                  round_speedups=[round(x, 3) for x in ratios])


def add_costs(records: list[dict[str, Any]], price_per_hour: float) -> None:
    """Cost per million output tokens at the measured throughput; saving against ``ar``."""
    ar = {(r["batch_size"], r["temperature"]): r for r in records if r["mode"] == "ar"}
    for rec in records:
        tps = rec["tokens_per_s"]
        if not tps:
            continue
        rec["cost_per_million_tokens"] = cost_per_million(tps, price_per_hour)
        base = ar.get((rec["batch_size"], rec["temperature"]))
        if base and base["tokens_per_s"]:
            rec["saving_vs_ar"] = 1.0 - base["tokens_per_s"] / tps


def cost_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """Dollars per 1e6 output tokens for a device rented at ``price_per_hour``."""
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


def calibration_rows(engine: Any) -> list[dict[str, Any]]:
    """An adaptive engine's start-up calibration (``engine.spec.arm_calibration``) as records:
    arm, batch size, greedy or sampled, step ms and verify tokens; empty where it did not run."""
    from engine.spec.adaptive import budget_label

    adaptive = getattr(engine, "adaptive", None)
    return [
        {"arm": budget_label(t.arm), "batch_size": t.batch_size, "sampled": t.sampled,
         "step_ms": round(t.seconds * 1000, 4), "verify_tokens": t.verify_tokens}
        for t in (adaptive.calibration if adaptive is not None else [])
    ]  # fmt: skip
