"""Documented default draft-tree shapes per device, and SpecConfig -> TreeBudget resolution.

CPU: compute grows with every verified token, so the default tree is narrow and deep enough to
use the trained MTP modules (chosen by measurement on the demo model: see README, "Speculation
defaults"). GPU: a verify step costs about the same for tens of tokens, so the tree is wider.
"""

from __future__ import annotations

from engine.params import SpecConfig
from engine.simulator import AcceptanceStats, optimal_tree
from engine.simulator.tree_shape import TreeShape
from engine.spec.drafter import TreeBudget

CPU_TREE = TreeBudget(topk=2, depth=6, num_draft_tokens=10, min_path_prob=0.15)
GPU_TREE = TreeBudget(topk=4, depth=6, num_draft_tokens=32)  # full trees keep CUDA graphs usable
CHAIN_DEPTH = 4


def resolve_budget(spec: SpecConfig, device_type: str, vocab_size: int) -> TreeBudget:
    """The static budget of ``spec`` (``adaptive`` starts from the tree default)."""
    if spec.method == "none":
        return TreeBudget(topk=1, depth=0, num_draft_tokens=0)
    if spec.method == "chain":
        depth = spec.num_draft_tokens or spec.depth or CHAIN_DEPTH
        return TreeBudget(topk=1, depth=depth, num_draft_tokens=depth)
    base = GPU_TREE if device_type == "cuda" else CPU_TREE
    topk = min(spec.topk or base.topk, vocab_size)
    depth = spec.depth or base.depth
    budget = spec.num_draft_tokens or base.num_draft_tokens
    return TreeBudget(
        topk=topk,
        depth=depth,
        num_draft_tokens=budget,
        min_path_prob=base.min_path_prob if spec.min_path_prob is None else spec.min_path_prob,
    )


# Acceptance per depth and sibling rank assumed for sampled trees before live statistics exist
# (measured on the demo model at temperature 1.0, rounded down).
SAMPLED_PRIOR = AcceptanceStats(tuple((0.55, 0.12, 0.05, 0.02) for _ in range(8)))
LIVE_STATS_MIN_STEPS = 64


def sampled_tree_shape(budget: TreeBudget, snapshot: dict[str, object] | None) -> TreeShape:
    """The optimiser's best shape for sampled trees of this budget (one model of the trade-off).

    Children counts come from a node's position in the shape (its rank = draw order), never from
    drawn values, which keeps multi-draft rejection sampling exact.
    """
    stats = SAMPLED_PRIOR
    if snapshot is not None and int(snapshot.get("num_steps", 0)) >= LIVE_STATS_MIN_STEPS:  # type: ignore[call-overload]
        try:
            stats = AcceptanceStats.from_dict(snapshot)
        except ValueError:
            stats = SAMPLED_PRIOR
    return optimal_tree(stats, budget.num_draft_tokens, max_depth=budget.depth, max_width=budget.topk)
