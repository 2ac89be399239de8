"""Monte Carlo check of the analytic expectation: simulate verify steps with i.i.d. outcomes.

Each simulated step walks down from the root. At an accepted node of depth ``d`` one outcome is
drawn from ``rank_accept[d]``: "the path continues through rank ``r``" with probability
``rank_accept[d][r]`` (over *all* ranks, drafted or not) and "no child accepted" with the rest. If
the drawn rank is one of the node's children in the shape, the walk moves there; otherwise the
step ends. This is what the marginal definition of ``rank_accept`` means, independently of the
closed form in ``expected.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.tree_shape import TreeShape


@dataclass(frozen=True)
class MonteCarloResult:
    """Simulated accepted lengths (tokens per step, bonus included)."""

    mean_length: float
    std_error: float
    accepted_per_position: list[float]  # [d] = share of steps whose path reached depth d + 1
    num_steps: int


def simulate(
    shape: TreeShape, stats: AcceptanceStats, num_steps: int, seed: int = 0
) -> MonteCarloResult:
    """Simulate ``num_steps`` independent verify steps of ``shape``."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    rng = np.random.default_rng(seed)
    depths = shape.depths
    max_rank = max(len(row) for row in stats.rank_accept)
    child = np.full((shape.num_nodes, max_rank + 1), -1, dtype=np.int64)  # [node, rank]
    for i in range(1, shape.num_nodes):
        if shape.ranks[i] < max_rank:
            child[shape.parents[i], shape.ranks[i]] = i
    # cumulative outcome probabilities per node: [node, max_rank]; column max_rank = "none"
    cum = np.ones((shape.num_nodes, max_rank + 1))
    for i in range(shape.num_nodes):
        row = stats.row(depths[i])
        cum[i, : len(row)] = np.cumsum(row)
        cum[i, len(row) : max_rank] = cum[i, len(row) - 1]

    node = np.zeros(num_steps, dtype=np.int64)
    length = np.ones(num_steps)
    reached = np.zeros(shape.max_depth)
    alive = np.ones(num_steps, dtype=bool)
    for depth in range(shape.max_depth):
        u = rng.random(num_steps)
        outcome = (u[:, None] >= cum[node]).sum(axis=1)  # rank drawn, max_rank = none
        nxt = child[node, np.minimum(outcome, max_rank)]
        alive &= nxt >= 0
        reached[depth] = alive.sum()
        length += alive
        node = np.where(alive, nxt, 0)
        if not alive.any():
            break
    return MonteCarloResult(
        mean_length=float(length.mean()),
        std_error=float(length.std(ddof=1) / np.sqrt(num_steps)) if num_steps > 1 else 0.0,
        accepted_per_position=[float(r) / num_steps for r in reached],
        num_steps=num_steps,
    )
