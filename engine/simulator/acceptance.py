"""Acceptance statistics: how likely the target accepts a drafted child, per depth and rank.

Terms:
  - *depth*: the root (the pending token) is depth 0; its drafted children are depth 1, and so on.
  - *rank*: a child's position among its siblings, 0-based, ordered by draft probability (rank 0 is
    the drafter's top choice). A tree's children of one node always hold ranks ``0 .. k-1``.
  - ``rank_accept[d][r]``: the *marginal* probability that, given the node at depth ``d`` was
    accepted and its children of ranks ``0 .. r`` were offered, the accepted path continues through
    the child of rank ``r`` (at depth ``d + 1``). Verification tries rank ``r`` only after the better
    ranks were rejected, so this is not a conditional "accept rank r if tried" rate but the share of
    all outcomes; the ranks of one depth therefore sum to at most 1 (the rest is "no child
    accepted"). Under greedy verification it is P(target's token == drafter's rank-r token).
  - Depths beyond the measured ones reuse the last measured depth; ranks beyond the measured ones
    have probability 0.

Sources: a JSON file (``{"rank_accept": [[...], ...]}``), counters exported by
``LLMEngine.acceptance_snapshot()`` (``from_counts``), or per-position counters of a chain run
(``from_position_counts``, e.g. from the Prometheus ``..._per_position_total`` counters).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.simulator.json_file import read_json

# Ranks of one depth may sum to slightly above 1 after rounding in a JSON file.
_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class AcceptanceStats:
    """Per-depth, per-rank marginal acceptance probabilities (see the module docstring).

    ``rank_accept[d][r]`` is for the rank-``r`` child at depth ``d + 1``. Validated on
    construction: a bad value raises ``ValueError`` naming the depth and rank.
    """

    rank_accept: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        rows = _as_rows(self.rank_accept, "rank_accept")
        object.__setattr__(self, "rank_accept", rows)

    @property
    def num_depths(self) -> int:
        """Number of measured depths (deeper ones reuse the last)."""
        return len(self.rank_accept)

    def row(self, depth: int) -> tuple[float, ...]:
        """Rank probabilities of the children at depth ``depth + 1`` (``depth`` is the parent's)."""
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        return self.rank_accept[min(depth, len(self.rank_accept) - 1)]

    def prob(self, depth: int, rank: int) -> float:
        """P(path continues through the rank-``rank`` child of an accepted node at ``depth``)."""
        row = self.row(depth)
        return row[rank] if 0 <= rank < len(row) else 0.0

    def max_rank(self, depth: int) -> int:
        """Number of ranks with a positive probability at the parent depth ``depth``."""
        row = self.row(depth)
        k = len(row)
        while k > 0 and row[k - 1] <= 0.0:
            k -= 1
        return k

    def is_rank_monotone(self) -> bool:
        """True when every depth's probabilities do not increase with rank (greedy is exact)."""
        return all(
            all(a >= b for a, b in zip(row, row[1:], strict=False)) for row in self.rank_accept
        )

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def chain(cls, per_depth: Sequence[float]) -> AcceptanceStats:
        """Stats with only rank 0: ``per_depth[d]`` = P(depth d+1 accepted | depth d accepted)."""
        return cls(tuple((float(p),) for p in per_depth))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AcceptanceStats:
        """Parse ``{"rank_accept": [[...], ...]}`` or an ``acceptance_snapshot()`` dict."""
        if not isinstance(data, Mapping):
            raise ValueError(f"acceptance stats must be a JSON object, got {type(data).__name__}")
        if "rank_accept" in data:
            return cls(data["rank_accept"])
        if "depth_rank_accepted" in data:
            return cls.from_counts(
                data["depth_rank_accepted"],
                data.get("depth_reached"),
                depth_rank_offered=data.get("depth_rank_offered"),
            )
        raise ValueError(
            "acceptance stats need a 'rank_accept' list of per-depth rank probabilities or the "
            "counters 'depth_rank_accepted' and 'depth_reached' (LLMEngine.acceptance_snapshot())"
        )

    @classmethod
    def from_json(cls, path: str | Path) -> AcceptanceStats:
        """Read stats from a JSON file (either format of ``from_dict``)."""
        data = read_json(path)
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {"rank_accept": [list(row) for row in self.rank_accept]}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_counts(
        cls,
        depth_rank_accepted: Sequence[Sequence[int]],
        depth_reached: Sequence[int] | None,
        depth_rank_offered: Sequence[Sequence[int]] | None = None,
    ) -> AcceptanceStats:
        """Estimate the stats from counters of verify outcomes.

        Args:
            depth_rank_accepted: ``[d][r]`` = how often the accepted path went from an accepted
                node at depth ``d`` through its rank-``r`` child.
            depth_reached: ``[d]`` = how often an accepted node at depth ``d`` had children
                offered (``[0]`` is the number of verify steps with drafts). The denominator for
                every rank when ``depth_rank_offered`` is absent, which is exact when every
                reached node offered all counted ranks (full top-k expansion).
            depth_rank_offered: optional ``[d][r]`` = how often an accepted node at depth ``d``
                offered a rank-``r`` child; a better denominator for pruned (dynamic) trees.

        Depths never reached are dropped (deeper depths then reuse the last estimated one).

        Raises:
            ValueError: counters of the wrong shape, negative, or accepted > reached.
        """
        accepted = _count_rows(depth_rank_accepted, "depth_rank_accepted")
        if depth_rank_offered is not None:
            offered = _count_rows(depth_rank_offered, "depth_rank_offered")
            if len(offered) != len(accepted) or any(
                len(o) != len(a) for o, a in zip(offered, accepted, strict=True)
            ):
                raise ValueError("depth_rank_offered must have the shape of depth_rank_accepted")
        elif depth_reached is None:
            raise ValueError("counts need 'depth_reached' (or 'depth_rank_offered')")
        else:
            reached = _count_list(depth_reached, "depth_reached")
            if len(reached) < len(accepted):
                raise ValueError(
                    f"depth_reached has {len(reached)} depths but depth_rank_accepted has "
                    f"{len(accepted)}"
                )
            # A depth reached but never accepted through counts rank 0, accepted 0 times.
            accepted = [row or [0] for row in accepted]
            offered = [[reached[d]] * len(row) for d, row in enumerate(accepted)]
        rows: list[tuple[float, ...]] = []
        for d, (acc_row, off_row) in enumerate(zip(accepted, offered, strict=True)):
            if not acc_row or max(off_row) == 0:
                break  # never reached: deeper depths reuse the last estimated one
            probs = []
            for r, (a, o) in enumerate(zip(acc_row, off_row, strict=True)):
                if a > o:
                    raise ValueError(
                        f"depth {d} rank {r}: accepted {a} times but offered only {o} times"
                    )
                probs.append(a / o if o > 0 else 0.0)
            total = sum(probs)
            if total > 1.0:  # separate denominators per rank can overshoot on small samples
                probs = [p / total for p in probs]
            rows.append(tuple(probs))
        if not rows:
            raise ValueError("the counters hold no verify step with drafted tokens")
        return cls(tuple(rows))

    @classmethod
    def from_position_counts(
        cls, accepted_per_position: Sequence[int], num_steps: int
    ) -> AcceptanceStats:
        """Chain statistics from ``SpecStats.accepted_per_position`` and ``num_steps``.

        ``accepted_per_position[d]`` counts steps whose accepted path reached depth ``d + 1``;
        the conditional rate of depth ``d + 1`` is the ratio of consecutive counts. All mass is
        put on rank 0, which is exact for chain runs only.
        """
        counts = _count_list(accepted_per_position, "accepted_per_position")
        if not isinstance(num_steps, int) or num_steps <= 0:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        reached = [num_steps, *counts]
        probs = []
        for d, acc in enumerate(counts):
            if reached[d] == 0:
                break
            if acc > reached[d]:
                raise ValueError(
                    f"accepted_per_position[{d}]={acc} exceeds the count of the depth above "
                    f"({reached[d]})"
                )
            probs.append(acc / reached[d])
        if not probs:
            raise ValueError("accepted_per_position is empty")
        return cls.chain(probs)


def _as_rows(value: Any, name: str) -> tuple[tuple[float, ...], ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) == 0:
        raise ValueError(f"{name} must be a non-empty list of per-depth lists of probabilities")
    rows = []
    for d, row in enumerate(value):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence) or len(row) == 0:
            raise ValueError(f"{name}[{d}] must be a non-empty list of per-rank probabilities")
        probs = []
        for r, p in enumerate(row):
            if isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p):
                raise ValueError(f"{name}[{d}][{r}] must be a number, got {p!r}")
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name}[{d}][{r}] must be in [0, 1], got {p!r}")
            probs.append(float(p))
        if sum(probs) > 1.0 + _SUM_TOLERANCE:
            raise ValueError(
                f"{name}[{d}] sums to {sum(probs):.6g} > 1: ranks must hold marginal "
                "probabilities that the path continues through them"
            )
        rows.append(tuple(probs))
    return tuple(rows)


def _count_list(value: Any, name: str) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of non-negative integers")
    out = []
    for i, c in enumerate(value):
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative integer, got {c!r}")
        out.append(c)
    return out


def _count_rows(value: Any, name: str) -> list[list[int]]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of per-depth lists of counts")
    return [_count_list(row, f"{name}[{d}]") for d, row in enumerate(value)]
