"""Live acceptance statistics per draft depth and sibling rank (the simulator's input).

For every verify step and every accepted node that had children: ``depth_reached[d]`` counts
that a node at depth d was accepted and offered children; ``depth_rank_accepted[d][r]`` counts
that its child of sibling rank r was the one accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.spec.tree import DraftTree

# Batches of at least this many paths are counted with array operations (a fixed ~50 us on the
# CI machine's CPU); smaller ones path by path (~4 us each): at batch 1 the array operations
# would add ~2.5% to a graphed H200 step.
VECTORISED_MIN_PATHS = 16


class AcceptanceCounter:
    def __init__(self) -> None:
        self.num_steps = 0
        self.depth_reached: list[int] = []
        self.depth_rank_accepted: list[list[int]] = []

    def record(self, tree: DraftTree, accepted: list[int]) -> None:
        self.record_path(
            [bool(tree.children(node)) for node in accepted],
            [tree.sibling_rank(node) for node in accepted[1:]],
        )

    def record_path(self, has_children: list[bool], child_ranks: list[int]) -> None:
        """One verify step: for the accepted node at depth j (the root is depth 0), whether it
        had children, and the sibling rank of the accepted node at depth j + 1."""
        self.num_steps += 1
        for depth, offered in enumerate(has_children):
            if not offered:
                continue
            while len(self.depth_reached) <= depth:
                self.depth_reached.append(0)
                self.depth_rank_accepted.append([])
            self.depth_reached[depth] += 1
            if depth < len(child_ranks):
                rank = child_ranks[depth]
                ranks = self.depth_rank_accepted[depth]
                while len(ranks) <= rank:
                    ranks.append(0)
                ranks[rank] += 1

    def record_paths(
        self, num_accepted: Sequence[int], has_child: np.ndarray, ranks: np.ndarray
    ) -> None:
        """One verify step of a batch of trees of depth ``D``: per tree, its accepted draft
        tokens ``a``, whether the path's node at depth j had children (``has_child`` [n, D + 1],
        read for j <= a) and the sibling rank of the path's node at depth j (``ranks``
        [n, D + 1], read for 1 <= j <= a). The same counts as ``record_path`` per tree."""
        n = len(num_accepted)
        if n < VECTORISED_MIN_PATHS:
            for a, has, rank in zip(num_accepted, has_child.tolist(), ranks.tolist(), strict=True):
                self.record_path([bool(h) for h in has[: a + 1]], rank[1 : a + 1])
            return
        accepted = np.asarray(num_accepted)[:, None]  # [n, 1]
        has = has_child.astype(bool)  # [n, D + 1]
        depth = np.arange(has.shape[1])[None]  # [1, D + 1]
        offered = has & (depth <= accepted)  # the path's node at depth j was accepted and had children
        child = offered & (depth < accepted)  # ... and its child on the path was accepted too
        child_rank = ranks[:, 1:]  # [n, D] rank of the path's node at depth j + 1
        self.num_steps += n
        for d in np.flatnonzero(offered.any(0)).tolist():
            while len(self.depth_reached) <= d:
                self.depth_reached.append(0)
                self.depth_rank_accepted.append([])
            self.depth_reached[d] += int(offered[:, d].sum())
            if d < child_rank.shape[1] and child[:, d].any():
                counts = np.bincount(child_rank[child[:, d], d]).tolist()
                ranks_d = self.depth_rank_accepted[d]
                if len(ranks_d) < len(counts):
                    ranks_d.extend([0] * (len(counts) - len(ranks_d)))
                for r, c in enumerate(counts):
                    ranks_d[r] += c

    def snapshot(self) -> dict[str, object]:
        return {
            "num_steps": self.num_steps,
            "depth_reached": list(self.depth_reached),
            "depth_rank_accepted": [list(r) for r in self.depth_rank_accepted],
        }
