"""``mtpserve simulate``: predicted speedup of speculation, and the best tree per batch size.

Usage::

    mtpserve simulate --stats STATS.json (--latency LATENCY.json | --arm-costs SNAPSHOT.json
        [--sampled-costs]) [--budget N]
        [--batch-sizes 1 2 4 ...] [--max-depth D] [--max-width K] [--tree SPEC|FILE]
        [--measured RUNS.json] [--closed-batch-tokens T [--yield-spread FILE]]
        [--out simulate.png] [--recommend-default]

Prints, per batch size, the budget and tree with the most predicted tokens/s (budget 0 = no
speculation), draws the figure, and, when asked, the figures of one given tree (``--tree``:
``chain:N``, ``kary:K:N`` or a JSON shape file) and the prediction error against measured runs
(``--measured``, see ``validation.py``). ``--closed-batch-tokens`` also predicts batches that
nobody joins, whose drain under drafting comes from the spread of yields over sequences
(``relative_yields`` in ``--yield-spread`` or the stats file, as a live adaptive server's
``/admin/acceptance`` reports them): the model adaptive speculation charges drafting with
(``engine.spec.drain``). ``--recommend-default`` prints instead the drafter budget
(``topk``, ``depth``, ``num_draft_tokens``) of the best tree at the smallest batch size, which is
how the default trees of ``engine/spec/defaults.py`` are derived (``Derivation.command()`` there
gives the exact line per device), and writes no figure. ``--arm-costs`` takes the latency model
from a live engine's measured decode steps instead (``arm_costs`` in ``/admin/acceptance``, see
``arm_costs.py``): the costs adaptive speculation chooses by, host work included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.arm_costs import (
    fit_arm_costs,
    format_arm_costs,
    latency_from_arm_costs,
    load_arm_costs,
)
from engine.simulator.expected import closed_batch_estimate, estimate, node_probabilities
from engine.simulator.json_file import read_json
from engine.simulator.latency import LatencyModel
from engine.simulator.optimizer import SpeculationPlanner, best_budget
from engine.simulator.report import format_estimates, format_plans, write_figure
from engine.simulator.tree_shape import TreeShape
from engine.simulator.validation import load_measured_runs, prediction_errors


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mtpserve simulate",
        description="Predict the speedup of MTP tree speculation and choose the best tree.",
    )
    ap.add_argument("--stats", required=True, help="acceptance statistics JSON")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--latency", help="latency measurements JSON")
    source.add_argument(
        "--arm-costs", default=None,
        help="JSON with 'arm_costs' (a live adaptive engine's /admin/acceptance): the latency "
        "model is fitted to its measured decode steps",
    )  # fmt: skip
    ap.add_argument(
        "--sampled-costs", action="store_true",
        help="with --arm-costs: fit the sampled batches' arms (default: greedy)",
    )  # fmt: skip
    ap.add_argument("--budget", type=_positive, default=32, help="largest draft-node budget")
    ap.add_argument("--batch-sizes", type=_positive, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--max-depth", type=_positive, default=None, help="deepest draft depth")
    ap.add_argument("--max-width", type=_positive, default=None, help="most children per node")
    ap.add_argument("--tree", default=None, help="also evaluate this shape (spec or JSON file)")
    ap.add_argument("--measured", default=None, help="measured runs JSON: report the error")
    ap.add_argument(
        "--closed-batch-tokens", type=_positive, default=None,
        help="also predict closed batches (no newcomers) of sequences generating this many "
        "tokens each, whose drain under drafting comes from the spread of yields",
    )  # fmt: skip
    ap.add_argument(
        "--yield-spread", default=None,
        help="JSON with 'relative_yields' (a live server's /admin/acceptance has them); default: "
        "the --stats file's",
    )  # fmt: skip
    ap.add_argument("--out", default="simulate.png", help="PNG to write")
    ap.add_argument(
        "--recommend-default",
        action="store_true",
        help="print the default tree budget derived at the smallest batch size and exit",
    )
    return ap


def _recommend_default(
    stats: AcceptanceStats, latency: LatencyModel, args: argparse.Namespace, batch_size: int
) -> None:
    from engine.spec.defaults import budget_from_plan  # noqa: PLC0415 (torch)

    budgets = range(args.budget + 1)
    plan = best_budget(stats, latency, batch_size, budgets, args.max_depth, args.max_width)
    budget = budget_from_plan(plan)
    print(
        f"Default tree at batch {batch_size}: topk={budget.topk} depth={budget.depth} "
        f"num_draft_tokens={budget.num_draft_tokens}"
    )
    if plan.budget == 0:
        print("(speculation does not pay at this batch size: no tree)")
        return
    print(
        f"predicted accepted length {plan.expected_length:.3f}, {plan.tokens_per_s:.1f} tokens/s, "
        f"speedup {plan.speedup:.3f}x over autoregressive"
    )
    print(plan.shape.pretty(node_probabilities(plan.shape, stats)))
    print(f"widths per depth: {plan.widths_per_depth()}")


def _load_spread(path: str) -> list[float]:
    """``relative_yields`` of a JSON file (ValueError naming the file when absent or bad)."""
    data = read_json(path)
    values = data.get("relative_yields") if isinstance(data, dict) else None
    if not isinstance(values, list) or not values:
        raise ValueError(
            f"{path}: no 'relative_yields' list (an adaptive server's /admin/acceptance reports "
            "them once 16 sequences have finished; or pass --yield-spread FILE)"
        )
    if not all(isinstance(v, int | float) and v > 0 for v in values):
        raise ValueError(f"{path}: 'relative_yields' must be positive numbers")
    return [float(v) for v in values]


def _load_tree(spec: str) -> TreeShape:
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        return TreeShape.from_dict(read_json(path))
    return TreeShape.parse(spec)


def main(argv: list[str] | None = None) -> int:
    """Run ``mtpserve simulate`` with ``argv`` (the arguments after ``simulate``)."""
    args = _parser().parse_args(argv)
    try:
        stats = AcceptanceStats.from_json(args.stats)
        if args.arm_costs is not None:
            costs = load_arm_costs(read_json(args.arm_costs), args.arm_costs)
            print(format_arm_costs(costs, fit_arm_costs(costs, args.sampled_costs), args.sampled_costs))
            print()
            latency = latency_from_arm_costs(costs, args.sampled_costs)
        else:
            latency = LatencyModel.from_json(args.latency)
        batch_sizes = sorted(set(args.batch_sizes))
        if args.recommend_default:
            _recommend_default(stats, latency, args, batch_sizes[0])
            return 0
        planner = SpeculationPlanner(
            stats, latency, range(args.budget + 1), args.max_depth, args.max_width
        )
        plans = [planner.plan(b) for b in batch_sizes]
        print("Best speculation per batch size (budget 0 = autoregressive):")
        print(format_plans(plans))
        drawn = next((p for p in plans if p.budget > 0), None)
        if drawn is None:  # speculation never pays: still show the best tree of the top budget
            drawn = planner.plan_for_budget(batch_sizes[0], args.budget)
        print(f"\nTree at batch {drawn.batch_size} (rank, path probability):")
        print(drawn.shape.pretty(node_probabilities(drawn.shape, stats)))
        print(f"widths per depth: {drawn.widths_per_depth()}")
        if args.tree is not None:
            shape = _load_tree(args.tree)
            print(f"\nGiven tree {args.tree} ({shape.budget} nodes, depth {shape.max_depth}):")
            print(format_estimates([estimate(shape, stats, latency, b) for b in batch_sizes]))
        if args.closed_batch_tokens is not None:
            spread = _load_spread(args.yield_spread or args.stats)
            tokens = args.closed_batch_tokens
            print(f"\nClosed batches of {tokens} tokens per sequence ({len(spread)} relative "
                  "yields), each batch size's best tree (a speedup under 1: decode "
                  "autoregressively):")  # fmt: skip
            print(format_estimates([
                closed_batch_estimate(p.shape, stats, latency, p.batch_size, tokens,
                                      spread if p.budget else [1.0])
                for p in plans
            ]))  # fmt: skip
        if args.measured is not None:
            report = prediction_errors(stats, latency, load_measured_runs(args.measured))
            print("\nPrediction error against measured runs:")
            print(report.format())
        write_figure(args.out, planner, batch_sizes, drawn, stats)
        print(f"\nwrote {args.out}")
    except (ValueError, OSError) as exc:
        print(f"mtpserve simulate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
