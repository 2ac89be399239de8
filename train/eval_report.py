"""The evaluation's goals (issue 4, for the shipped demo model) and its short text table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Goal:
    key: str
    text: str
    mode: str  # a Mode.name
    figure: str  # a key of the mode's result, or "position1"
    op: str  # ">=" | "<="
    target: float


GOALS = (
    Goal("tree_t1_mean_accepted_length", "tree T=1.0 mean accepted length", "tree@T1",
         "mean_accepted_length", ">=", 3.0),
    Goal("tree_t1_position1_acceptance", "tree T=1.0 position-1 acceptance", "tree@T1",
         "position1", ">=", 0.72),
    Goal("tree_t1_repeated_4grams", "tree T=1.0 repeated 4-gram share", "tree@T1",
         "repeated_4gram_share", "<=", 0.30),
    Goal("tree_greedy_mean_accepted_length", "tree greedy mean accepted length", "tree@T0",
         "mean_accepted_length", ">=", 3.5),
)  # fmt: skip


def _figure(run: dict[str, Any], figure: str) -> float:
    if figure == "position1":
        per_position = run["acceptance_per_position"]
        return float(per_position[0]) if per_position else 0.0
    return float(run[figure])


def check_goals(modes: dict[str, dict[str, Any]], greedy_identical: bool) -> dict[str, Any]:
    """Each goal with its target, measured value and whether it is met (absent modes skipped)."""
    goals: dict[str, Any] = {}
    for g in GOALS:
        if g.mode not in modes:
            continue
        value = _figure(modes[g.mode], g.figure)
        met = value >= g.target if g.op == ">=" else value <= g.target
        goals[g.key] = {"goal": f"{g.text} {g.op} {g.target:g}", "value": value, "met": met}
    goals["greedy_identical_to_ar"] = {
        "goal": "greedy output of every speculative mode identical to autoregressive",
        "value": greedy_identical,
        "met": greedy_identical,
    }
    return goals


def format_table(result: dict[str, Any]) -> str:
    """A short human-readable summary of an evaluation result (the JSON holds everything)."""
    setup, teacher = result["setup"], result["teacher_forced"]
    lines = [
        f"mtpserve eval: {setup['model']} ({setup['num_prompts']} prompts x "
        f"{setup['max_tokens']} new tokens, {setup['device']} {setup['dtype']}, "
        f"load {setup['loadavg_before'][0]:.2f} -> {setup['loadavg_after'][0]:.2f})",
        f"teacher-forced on {teacher['tokens']} held-out tokens: "
        f"perplexity {teacher['perplexity']:.3f} (loss {teacher['loss']:.4f})",
        "  MTP depth          " + "".join(f"{d + 1:>7d}" for d in range(len(teacher["mtp_loss"]))),
        "  greedy agreement   " + "".join(f"{a:7.3f}" for a in teacher["greedy_agreement"]),
        "  sampled acceptance " + "".join(f"{a:7.3f}" for a in teacher["sampled_acceptance"]),
        "",
        f"{'':<9} {'':>7} {'':<29} {'':>6} {'batched':^15} {'batch 1':^15}",
        f"{'mode':<9} {'acc.len':>7} {'per-position acceptance':<29} {'rep4g':>6} "
        + f"{'tok/s':>7} {'speedup':>7} " * 2,
    ]
    for name, run in result["modes"].items():
        positions = " ".join(f"{p:.2f}" for p in run["acceptance_per_position"]) or "-"
        lines.append(
            f"{name:<9} {run['mean_accepted_length']:7.2f} {positions:<29} "
            f"{run['repeated_4gram_share']:6.3f} "
            f"{run['tokens_per_s']:7.1f} {run['speedup_vs_ar']:6.2f}x "
            f"{run['batch1_tokens_per_s']:7.1f} {run['batch1_speedup_vs_ar']:6.2f}x"
        )
    lines.append(
        f"{'real code':<9} {'':>7} {'':<29} {result['reference']['repeated_4gram_share']:6.3f}"
    )
    lines.append("")
    for goal in result["goals"].values():
        value = goal["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"[{'met' if goal['met'] else 'MISSED':>6}] {goal['goal']}: {shown}")
    return "\n".join(lines)
