"""Draft-tree shapes: which nodes a step drafts, independent of the tokens in them.

A shape follows the layout of ``engine/spec/tree.py``: node 0 is the **root** (the pending
token, not a draft), ``parents[0] == -1`` and ``parents[i] < i`` for every other node (parents
before children). ``ranks[i]`` is node ``i``'s rank among its siblings (0 = the drafter's top
choice); the children of one node hold the ranks ``0 .. k-1``, since a drafter expands a node with
its top-k tokens. The *budget* of a shape is its number of draft nodes, root excluded
(``SpecConfig.num_draft_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# A shape as nested lists: each list holds the subtrees of a node's children, in rank order.
Nested = list[Any]


@dataclass(frozen=True)
class TreeShape:
    """A draft-tree shape, root included at index 0 (see the module docstring)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        parents = tuple(int(p) for p in self.parents)
        ranks = tuple(int(r) for r in self.ranks)
        if len(parents) == 0 or parents[0] != -1:
            raise ValueError("a tree shape starts with the root: parents[0] must be -1")
        if len(ranks) != len(parents):
            raise ValueError(f"ranks has {len(ranks)} entries but parents has {len(parents)}")
        seen: list[list[int]] = [[] for _ in parents]
        for i in range(1, len(parents)):
            if not 0 <= parents[i] < i:
                raise ValueError(
                    f"parents[{i}]={parents[i]}: every node's parent must come before it"
                )
            seen[parents[i]].append(ranks[i])
        for i, child_ranks in enumerate(seen):
            if sorted(child_ranks) != list(range(len(child_ranks))):
                raise ValueError(
                    f"children of node {i} have ranks {sorted(child_ranks)}; they must be "
                    f"0..{len(child_ranks) - 1}"
                )
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "ranks", ranks)

    # ---- structure ----------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes including the root (tokens per sequence in a verify step)."""
        return len(self.parents)

    @property
    def budget(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.parents) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        out = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            out[i] = out[self.parents[i]] + 1
        return tuple(out)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in rank order."""
        kids = [i for i in range(1, len(self.parents)) if self.parents[i] == node]
        return sorted(kids, key=lambda i: self.ranks[i])

    def widths_per_depth(self) -> list[int]:
        """``[d]`` = number of nodes at depth ``d + 1`` (root excluded)."""
        out = [0] * self.max_depth
        for depth in self.depths[1:]:
            out[depth - 1] += 1
        return out

    def expanded_per_depth(self) -> list[int]:
        """``[d]`` = nodes at depth ``d`` that have children (inputs of draft depth ``d + 1``)."""
        has_kids = [False] * len(self.parents)
        for p in self.parents[1:]:
            has_kids[p] = True
        out = [0] * self.max_depth
        for node, depth in enumerate(self.depths):
            if has_kids[node]:
                out[depth] += 1
        return out

    @property
    def max_children(self) -> int:
        """Largest number of children of one node (the top-k a drafter must expand)."""
        counts = [0] * len(self.parents)
        for p in self.parents[1:]:
            counts[p] += 1
        return max(counts)

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def root_only(cls) -> TreeShape:
        """No speculation: the verify step runs the pending token alone."""
        return cls((-1,), (0,))

    @classmethod
    def chain(cls, n: int) -> TreeShape:
        """A chain of ``n`` draft nodes (rank 0 at each depth)."""
        if n < 0:
            raise ValueError(f"chain length must be >= 0, got {n}")
        return cls(tuple(range(-1, n)), (0,) * (n + 1))

    @classmethod
    def kary(cls, k: int, n: int) -> TreeShape:
        """``n`` draft nodes filled breadth-first into a ``k``-ary tree (``k=1`` is a chain)."""
        if k < 1 or n < 0:
            raise ValueError(f"k-ary tree needs k >= 1 and n >= 0, got k={k}, n={n}")
        parents, ranks = [-1], [0]
        for i in range(1, n + 1):
            parents.append((i - 1) // k)
            ranks.append((i - 1) % k)
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def from_nested(cls, nested: Nested) -> TreeShape:
        """Build from nested lists: ``[[[]], []]`` is a root with two children, the first of
        which has one child."""
        parents, ranks = [-1], [0]
        stack: list[tuple[int, Nested]] = [(0, nested)]
        while stack:  # breadth order is not needed: parents are appended before children
            node, kids = stack.pop()
            if not isinstance(kids, list):
                raise ValueError(f"nested tree must hold lists, got {kids!r}")
            for rank, sub in enumerate(kids):
                parents.append(node)
                ranks.append(rank)
                stack.append((len(parents) - 1, sub))
        return cls(tuple(parents), tuple(ranks))

    def to_nested(self) -> Nested:
        def build(node: int) -> Nested:
            return [build(c) for c in self.children(node)]

        return build(0)

    def canonical(self) -> TreeShape:
        """The same shape renumbered in depth-first rank order (equal shapes compare equal)."""
        return TreeShape.from_nested(self.to_nested())

    @classmethod
    def from_dict(cls, data: Any) -> TreeShape:
        """Parse ``{"parents": [...], "ranks": [...]}`` (root included) or ``{"nested": ...}``."""
        if not isinstance(data, dict):
            raise ValueError(f"a tree shape must be a JSON object, got {type(data).__name__}")
        if "nested" in data:
            return cls.from_nested(data["nested"])
        if "parents" not in data:
            raise ValueError("a tree shape needs 'parents' (root first, -1) or 'nested'")
        parents = data["parents"]
        if not isinstance(parents, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in parents
        ):
            raise ValueError("'parents' must be a list of integers")
        ranks = data.get("ranks")
        if ranks is None:  # ranks follow the order of the nodes among their siblings
            counter: dict[int, int] = {}
            ranks = []
            for p in parents:
                ranks.append(counter.get(p, 0))
                counter[p] = counter.get(p, 0) + 1
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in ranks
        ):
            raise ValueError("'ranks' must be a list of integers")
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def parse(cls, spec: str) -> TreeShape:
        """Parse ``"chain:N"``, ``"kary:K:N"`` (``N`` draft nodes) or ``"none"``."""
        parts = spec.strip().lower().split(":")
        try:
            if parts == ["none"]:
                return cls.root_only()
            if parts[0] == "chain" and len(parts) == 2:
                return cls.chain(int(parts[1]))
            if parts[0] == "kary" and len(parts) == 3:
                return cls.kary(int(parts[1]), int(parts[2]))
        except ValueError as exc:
            raise ValueError(f"tree spec {spec!r}: {exc}") from exc
        raise ValueError(f"tree spec {spec!r}: expected 'none', 'chain:N' or 'kary:K:N'")

    def to_dict(self) -> dict[str, list[int]]:
        return {"parents": list(self.parents), "ranks": list(self.ranks)}

    # ---- display ------------------------------------------------------------------------------

    def pretty(self, probabilities: Sequence[float] | None = None) -> str:
        """An indented drawing; ``probabilities[i]`` (path probability) is shown when given."""
        lines: list[str] = []

        def walk(node: int, prefix: str, last: bool) -> None:
            label = "root" if node == 0 else f"r{self.ranks[node]}"
            if probabilities is not None:
                label += f" ({probabilities[node]:.3f})"
            if node == 0:
                lines.append(label)
                child_prefix = ""
            else:
                lines.append(prefix + ("└─ " if last else "├─ ") + label)
                child_prefix = prefix + ("   " if last else "│  ")
            kids = self.children(node)
            for j, c in enumerate(kids):
                walk(c, child_prefix, j == len(kids) - 1)

        walk(0, "", True)
        return "\n".join(lines)


def enumerate_shapes(n: int, max_depth: int | None = None) -> list[TreeShape]:
    """Every distinct shape with exactly ``n`` draft nodes (for tests; grows fast with ``n``).

    With ranked children, a shape is an ordered forest under the root, so there are
    Catalan(n) of them.
    """

    def forests(size: int, depth_left: int) -> list[Nested]:
        # ordered forests of `size` nodes whose trees are at most `depth_left` deep
        if size == 0:
            return [[]]
        if depth_left == 0:
            return []
        out: list[Nested] = []
        for first in range(1, size + 1):  # nodes in the first tree (its root + subtree)
            for sub in forests(first - 1, depth_left - 1):
                for rest in forests(size - first, depth_left):
                    out.append([sub, *rest])
        return out

    limit = n if max_depth is None else max_depth
    return [TreeShape.from_nested(f) for f in forests(n, limit)]
