"""Draft-tree simulator and optimiser: what speculation gives on a model, traffic and GPU.

Inputs are acceptance statistics per depth and sibling rank (``AcceptanceStats``) and a latency
model of verify and draft steps (``LatencyModel``). Outputs are the expected accepted length,
tokens/s and speedup of a tree shape (``estimate``), the exact optimal tree for a node budget
(``optimal_tree``) and the budget and tree with the most tokens/s per batch size
(``SpeculationPlanner.plan`` / ``best_budget``), which the scheduler uses for adaptive
speculation and the tree defaults.
"""

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import (
    Estimate,
    closed_batch_estimate,
    estimate,
    expected_accepted_per_position,
    expected_length,
    node_probabilities,
)
from engine.simulator.latency import LatencyModel
from engine.simulator.montecarlo import MonteCarloResult, simulate
from engine.simulator.optimizer import (
    SpeculationPlanner,
    TreeOptimizer,
    TreePlan,
    best_budget,
    greedy_tree,
    optimal_tree,
)
from engine.simulator.tree_shape import TreeShape
from engine.simulator.validation import MeasuredRun, ValidationReport, prediction_errors

__all__ = [
    "AcceptanceStats",
    "Estimate",
    "LatencyModel",
    "MeasuredRun",
    "MonteCarloResult",
    "SpeculationPlanner",
    "TreeOptimizer",
    "TreePlan",
    "TreeShape",
    "ValidationReport",
    "best_budget",
    "closed_batch_estimate",
    "estimate",
    "expected_accepted_per_position",
    "expected_length",
    "greedy_tree",
    "node_probabilities",
    "optimal_tree",
    "prediction_errors",
    "simulate",
]
