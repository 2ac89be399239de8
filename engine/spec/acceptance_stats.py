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
        self.num_steps += 1
        for pos, node in enumerate(accepted):
            if not tree.children(node):
                continue
            depth = tree.depth_list[node]
            while len(self.depth_reached) <= depth:
                self.depth_reached.append(0)
                self.depth_rank_accepted.append([])
            self.depth_reached[depth] += 1
            if pos + 1 < len(accepted):
                rank = tree.sibling_rank(accepted[pos + 1])
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
