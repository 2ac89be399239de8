"""Live acceptance statistics per draft depth and sibling rank (the simulator's input).

For every verify step and every accepted node that had children: ``depth_reached[d]`` counts
that a node at depth d was accepted and offered children; ``depth_rank_accepted[d][r]`` counts
that its child of sibling rank r was the one accepted.
"""

from __future__ import annotations

from engine.spec.tree import DraftTree


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

    def snapshot(self) -> dict[str, object]:
        return {
            "num_steps": self.num_steps,
            "depth_reached": list(self.depth_reached),
            "depth_rank_accepted": [list(r) for r in self.depth_rank_accepted],
        }
