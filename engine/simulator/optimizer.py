"""Optimal draft trees for a node budget, and the budget that maximises throughput.

The expected accepted length of a shape is ``1 + sum of its nodes' path probabilities``
(``expected.py``). With positional acceptance (a node's probability depends only on its depth and
sibling rank, as in Sequoia, Chen et al. 2024, arXiv:2402.12374), the best subtree below a node
depends only on that node's depth and the nodes it may use, which gives an exact dynamic
programme:

  ``g(d, n)``: the best sum of path probabilities (relative to the node) of at most ``n``
  descendants of a node at depth ``d``. Its children take ranks ``0, 1, ..`` without gaps; the
  rank-``r`` child with a subtree of ``m`` nodes (itself included) contributes
  ``p(d, r) * (1 + g(d + 1, m - 1))``, so ``g(d, .)`` is a max-plus knapsack over ranks:
  ``h_r(n) = max(0, max_{1<=m<=n} p(d, r) * (1 + g(d + 1, m - 1)) + h_{r+1}(n - m))``,
  ``g(d, n) = h_0(n)``, and ``g(D, n) = 0`` at the depth limit ``D``.

Depths beyond the measured ones share their statistics, so tables there depend only on the depth
left, and one solver serves every budget and depth limit. ``greedy_tree`` (add the frontier node
with the largest path probability) is exact too when probabilities never increase with rank
(``AcceptanceStats.is_rank_monotone``); the DP is exact in general.

Throughput also depends on the draft depths (one MTP forward each), so ``SpeculationPlanner``
scores the DP's best tree for every (budget, depth limit) pair with the latency model and keeps the
fastest, budget 0 (no speculation) included.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import Estimate, estimate
from engine.simulator.latency import LatencyModel
from engine.simulator.tree_shape import Nested, TreeShape

# Values closer than this count as equal; the solver then prefers fewer nodes.
_EPS = 1e-12


class TreeOptimizer:
    """Exact optimal shapes by expected accepted length, for every budget up to ``max_budget``.

    Args:
        stats: acceptance statistics.
        max_budget: largest number of draft nodes asked for.
        max_width: most children per node (the drafter's top-k); ``None``: every measured rank.
    """

    def __init__(
        self, stats: AcceptanceStats, max_budget: int, max_width: int | None = None
    ) -> None:
        if max_budget < 0:
            raise ValueError(f"budget must be >= 0, got {max_budget}")
        if max_width is not None and max_width < 1:
            raise ValueError(f"max_width must be >= 1, got {max_width}")
        self.stats = stats
        self.max_budget = max_budget
        self.max_width = max_width
        # (stats depth, levels left) -> (g [max_budget + 1], choices [ranks][max_budget + 1])
        self._tables: dict[tuple[int, int], tuple[np.ndarray, list[np.ndarray]]] = {}

    def _probs(self, depth: int) -> list[float]:
        k = self.stats.max_rank(depth)
        if self.max_width is not None:
            k = min(k, self.max_width)
        return [self.stats.prob(depth, r) for r in range(k)]

    def _table(self, depth: int, levels: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """``g(depth, .)`` when ``levels`` more depths may be drafted below ``depth``."""
        key = (min(depth, self.stats.num_depths - 1), levels)
        if key in self._tables:
            return self._tables[key]
        size = self.max_budget + 1
        if levels == 0:
            result: tuple[np.ndarray, list[np.ndarray]] = (np.zeros(size), [])
            self._tables[key] = result
            return result
        g_child, _ = self._table(depth + 1, levels - 1)
        n = np.arange(size)
        rest = n[:, None] - n[None, :]  # [n, m]: nodes left for the next ranks
        valid = rest >= 0
        rest = np.where(valid, rest, 0)
        h = np.zeros(size)
        choices: list[np.ndarray] = []
        for p in reversed(self._probs(depth)):
            gain = np.empty(size)  # gain[m]: this rank's child with a subtree of m nodes
            gain[0] = 0.0
            gain[1:] = p * (1.0 + g_child[:-1])
            total = np.where(valid, gain[None, :] + h[rest], -np.inf)  # [n, m]
            total[:, 0] = 0.0  # m = 0: no child of this rank, hence none of later ranks
            choice = np.argmax(total >= total.max(axis=1, keepdims=True) - _EPS, axis=1)
            h = total[n, choice]
            choices.append(choice)
        choices.reverse()
        result = (h, choices)
        self._tables[key] = result
        return result

    def best_value(self, budget: int, max_depth: int | None = None) -> float:
        """Largest expected accepted length with at most ``budget`` draft nodes."""
        self._check(budget)
        g, _ = self._table(0, budget if max_depth is None else min(max_depth, budget))
        return 1.0 + float(g[budget])

    def tree(self, budget: int, max_depth: int | None = None) -> TreeShape:
        """An optimal shape with at most ``budget`` nodes and depth ``<= max_depth``; among
        equal values the one with the fewest nodes."""
        self._check(budget)
        levels = budget if max_depth is None else min(max_depth, budget)
        if max_depth is not None and max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {max_depth}")

        def build(depth: int, levels_left: int, n: int) -> Nested:
            g, choices = self._table(depth, levels_left)
            n = int(np.argmax(g[: n + 1] >= g[n] - _EPS))  # fewest nodes reaching the value
            kids: Nested = []
            for choice in choices:
                m = int(choice[n])
                if m == 0:
                    break
                kids.append(build(depth + 1, levels_left - 1, m - 1))
                n -= m
            return kids

        return TreeShape.from_nested(build(0, levels, budget))

    def _check(self, budget: int) -> None:
        if not 0 <= budget <= self.max_budget:
            raise ValueError(f"budget must be in [0, {self.max_budget}], got {budget}")


def optimal_tree(
    stats: AcceptanceStats,
    budget: int,
    max_depth: int | None = None,
    max_width: int | None = None,
) -> TreeShape:
    """The shape with at most ``budget`` draft nodes that maximises the expected length."""
    return TreeOptimizer(stats, budget, max_width).tree(budget, max_depth)


def greedy_tree(
    stats: AcceptanceStats,
    budget: int,
    max_depth: int | None = None,
    max_width: int | None = None,
) -> TreeShape:
    """Add, ``budget`` times, the frontier node with the largest path probability.

    Exact when ``stats.is_rank_monotone()`` (every node is then no likelier than its parent and
    its better-ranked sibling, so the best ``budget`` nodes form a tree); a heuristic otherwise.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    limit = budget if max_depth is None else max_depth

    def width(depth: int) -> int:
        k = stats.max_rank(depth)
        return k if max_width is None else min(k, max_width)

    parents, ranks, probs, depths = [-1], [0], [1.0], [0]
    # (-path probability, tie order, parent, rank) of nodes that may be added next
    frontier: list[tuple[float, int, int, int]] = []
    order = 0

    def offer(parent: int, rank: int) -> None:
        nonlocal order
        if depths[parent] < limit and rank < width(depths[parent]):
            prob = probs[parent] * stats.prob(depths[parent], rank)
            heapq.heappush(frontier, (-prob, order, parent, rank))
            order += 1

    offer(0, 0)
    while frontier and len(parents) <= budget:
        neg, _, parent, rank = heapq.heappop(frontier)
        if -neg <= 0.0:
            break
        parents.append(parent)
        ranks.append(rank)
        probs.append(-neg)
        depths.append(depths[parent] + 1)
        offer(len(parents) - 1, 0)
        offer(parent, rank + 1)
    return TreeShape(tuple(parents), tuple(ranks))


@dataclass(frozen=True)
class TreePlan:
    """The planner's choice for one batch size: a shape and its predicted performance.

    ``budget == 0`` means "do not speculate" (plain autoregressive steps).
    """

    shape: TreeShape
    batch_size: int
    expected_length: float
    tokens_per_s: float
    ar_tokens_per_s: float
    step_seconds: float

    @classmethod
    def from_estimate(cls, shape: TreeShape, est: Estimate) -> TreePlan:
        return cls(
            shape,
            est.batch_size,
            est.expected_length,
            est.tokens_per_s,
            est.ar_tokens_per_s,
            est.step_seconds,
        )

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.ar_tokens_per_s

    @property
    def budget(self) -> int:
        """Draft nodes per sequence and step (``SpecConfig.num_draft_tokens``)."""
        return self.shape.budget

    @property
    def max_depth(self) -> int:
        """Draft depths (``SpecConfig.depth``); 0 when not speculating."""
        return self.shape.max_depth

    @property
    def topk(self) -> int:
        """Most children of one node (``SpecConfig.topk``); 0 when not speculating."""
        return self.shape.max_children if self.shape.budget else 0

    def widths_per_depth(self) -> list[int]:
        """``[d]`` = nodes to keep at depth ``d + 1`` (per-depth expansion widths)."""
        return self.shape.widths_per_depth()


class SpeculationPlanner:
    """Chooses the tree (or no speculation) that maximises tokens/s at each batch size.

    The optimal shapes depend only on the acceptance statistics; the latency model then ranks
    them per batch size. Plans are cached per batch size; build a new planner when the statistics
    change.

    Args:
        stats: acceptance statistics.
        latency: step-time model.
        budgets: candidate draft-node budgets (0 = no speculation is always included).
        max_depth: deepest draft depth allowed (``None``: as deep as the budget).
        max_width: most children per node (``None``: every measured rank).
    """

    def __init__(
        self,
        stats: AcceptanceStats,
        latency: LatencyModel,
        budgets: Iterable[int] = range(0, 33),
        max_depth: int | None = None,
        max_width: int | None = None,
    ) -> None:
        self.budgets = sorted({0, *budgets})
        if self.budgets[0] < 0:
            raise ValueError(f"budgets must be >= 0, got {self.budgets[0]}")
        if max_depth is not None and max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.stats = stats
        self.latency = latency
        self.optimizer = TreeOptimizer(stats, self.budgets[-1], max_width)
        # budget -> distinct optimal shapes, one per depth limit
        self.candidates: dict[int, list[TreeShape]] = {}
        for budget in self.budgets:
            deepest = budget if max_depth is None else min(max_depth, budget)
            shapes = {self.optimizer.tree(budget, d) for d in range(1, deepest + 1)}
            self.candidates[budget] = sorted(shapes, key=lambda s: (s.budget, s.max_depth)) or [
                TreeShape.root_only()
            ]
        self._plans: dict[tuple[int, int], TreePlan] = {}

    def plan_for_budget(self, batch_size: int, budget: int) -> TreePlan:
        """The fastest of the optimal shapes of ``budget`` at ``batch_size``."""
        key = (batch_size, budget)
        if key not in self._plans:
            if budget not in self.candidates:
                raise ValueError(f"budget {budget} is not among the planner's budgets")
            plans = [
                TreePlan.from_estimate(s, estimate(s, self.stats, self.latency, batch_size))
                for s in self.candidates[budget]
            ]
            self._plans[key] = max(plans, key=lambda p: p.tokens_per_s)
        return self._plans[key]

    def plan(self, batch_size: int) -> TreePlan:
        """The plan with the most tokens/s at ``batch_size`` (ties: the smaller budget)."""
        best = self.plan_for_budget(batch_size, 0)
        for budget in self.budgets[1:]:
            candidate = self.plan_for_budget(batch_size, budget)
            if candidate.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
                best = candidate
        return best

    def speedup_grid(self, batch_sizes: Sequence[int]) -> np.ndarray:
        """``[i, j]`` = speedup of the best shape of ``self.budgets[j]`` at ``batch_sizes[i]``."""
        return np.array(
            [[self.plan_for_budget(b, n).speedup for n in self.budgets] for b in batch_sizes]
        )


def best_budget(
    stats: AcceptanceStats,
    latency: LatencyModel,
    batch_size: int,
    budgets: Iterable[int] = range(0, 33),
    max_depth: int | None = None,
    max_width: int | None = None,
) -> TreePlan:
    """The budget and tree with the most tokens/s at ``batch_size`` (budget 0 included)."""
    return SpeculationPlanner(stats, latency, budgets, max_depth, max_width).plan(batch_size)
