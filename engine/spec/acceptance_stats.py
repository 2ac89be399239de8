"""Live acceptance statistics per draft depth and sibling rank (the simulator's input).

For every verify step and every accepted node that had children: ``depth_reached[d]`` counts
that a node at depth d was accepted and offered children; ``depth_rank_accepted[d][r]`` counts
that its child of sibling rank r was the one accepted; ``depth_rank_offered[d][r]`` that it had
a child of rank r (the rate's denominator: a chain's node offers rank 0 only, so counted with a
tree's steps under ``depth_reached`` its steps would read as the tree's siblings rejected).
Offered counts are reported while every step said how many children its nodes had.
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
        self.depth_rank_offered: list[list[int]] = []
        self._widths_known = True  # every step so far said how many children its nodes had

    def record(self, tree: DraftTree, accepted: list[int]) -> None:
        children = [len(tree.children(node)) for node in accepted]
        self.record_path([c > 0 for c in children], [tree.sibling_rank(node) for node in accepted[1:]], children)

    def record_path(
        self, has_children: list[bool], child_ranks: list[int], widths: Sequence[int] | None = None
    ) -> None:
        """One verify step: for the accepted node at depth j (the root is depth 0), whether it
        had children, and the sibling rank of the accepted node at depth j + 1; ``widths[j]``:
        how many children it had (None: not known)."""
        self.num_steps += 1
        if widths is None:
            self._widths_known = False
        for depth, offered in enumerate(has_children):
            if not offered:
                continue
            self._reach(depth)
            self.depth_reached[depth] += 1
            if widths is not None:
                self._offer(depth, widths[depth], 1)
            if depth < len(child_ranks):
                rank = child_ranks[depth]
                ranks = self.depth_rank_accepted[depth]
                while len(ranks) <= rank:
                    ranks.append(0)
                ranks[rank] += 1

    def record_paths(
        self, num_accepted: Sequence[int], has_child: np.ndarray, ranks: np.ndarray, width: int | None = None
    ) -> None:
        """One verify step of a batch of trees of depth ``D``: per tree, its accepted draft
        tokens ``a``, whether the path's node at depth j had children (``has_child`` [n, D + 1],
        read for j <= a) and the sibling rank of the path's node at depth j (``ranks``
        [n, D + 1], read for 1 <= j <= a); ``width``: the children a node with children had
        (the step's top-k; None: not known). The same counts as ``record_path`` per tree."""
        n = len(num_accepted)
        if n < VECTORISED_MIN_PATHS:
            for a, has, rank in zip(num_accepted, has_child.tolist(), ranks.tolist(), strict=True):
                widths = None if width is None else [width] * (a + 1)
                self.record_path([bool(h) for h in has[: a + 1]], rank[1 : a + 1], widths)
            return
        if width is None:
            self._widths_known = False
        accepted = np.asarray(num_accepted)[:, None]  # [n, 1]
        has = has_child.astype(bool)  # [n, D + 1]
        depth = np.arange(has.shape[1])[None]  # [1, D + 1]
        offered = has & (depth <= accepted)  # the path's node at depth j was accepted and had children
        child = offered & (depth < accepted)  # ... and its child on the path was accepted too
        child_rank = ranks[:, 1:]  # [n, D] rank of the path's node at depth j + 1
        self.num_steps += n
        for d in np.flatnonzero(offered.any(0)).tolist():
            self._reach(d)
            reached = int(offered[:, d].sum())
            self.depth_reached[d] += reached
            if width is not None:
                self._offer(d, width, reached)
            if d < child_rank.shape[1] and child[:, d].any():
                counts = np.bincount(child_rank[child[:, d], d]).tolist()
                ranks_d = self.depth_rank_accepted[d]
                if len(ranks_d) < len(counts):
                    ranks_d.extend([0] * (len(counts) - len(ranks_d)))
                for r, c in enumerate(counts):
                    ranks_d[r] += c

    def _reach(self, depth: int) -> None:
        while len(self.depth_reached) <= depth:
            self.depth_reached.append(0)
            self.depth_rank_accepted.append([])
            self.depth_rank_offered.append([])

    def _offer(self, depth: int, width: int, count: int) -> None:
        row = self.depth_rank_offered[depth]
        if len(row) < width:
            row.extend([0] * (width - len(row)))
        for r in range(width):
            row[r] += count

    def snapshot(self) -> dict[str, object]:
        """The counters (``AcceptanceStats.from_dict`` reads them); with the offered counts
        when known, the accepted rows then padded to their length."""
        accepted = [list(r) for r in self.depth_rank_accepted]
        snap: dict[str, object] = {
            "num_steps": self.num_steps,
            "depth_reached": list(self.depth_reached),
            "depth_rank_accepted": accepted,
        }
        if self._widths_known and self.num_steps:
            offered = [list(r) for r in self.depth_rank_offered]
            for acc, off in zip(accepted, offered, strict=True):
                acc.extend([0] * (len(off) - len(acc)))
                off.extend([0] * (len(acc) - len(off)))
            snap["depth_rank_offered"] = offered
        return snap
