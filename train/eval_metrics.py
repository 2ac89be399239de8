"""Figures computed from generated token sequences: loop share and pooled speculation statistics.

Terms:
  - *repeated n-gram share*: of all n-grams of a token sequence (``len - n + 1`` of them), the
    share whose tokens already occurred as an n-gram at an earlier start in the same sequence.
    Small models loop under greedy decoding; a loop is easy to draft, so it inflates acceptance.
    Pooled over sequences (total repeated / total n-grams), not averaged per sequence.
  - *mean accepted length*: tokens emitted per target forward after the prefill,
    ``1 + accepted drafts / verify steps``, pooled over every request of a run.
  - *per-position acceptance* ``[d]``: share of verify steps whose accepted path reached draft
    depth ``d + 1`` (``accepted_per_position[d] / num_steps``, as in DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class _Stats(Protocol):
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]


class _Output(Protocol):
    token_ids: list[int]
    finish_reason: str | None

    @property
    def stats(self) -> _Stats: ...


def repeated_ngram_counts(tokens: Sequence[int], n: int = 4) -> tuple[int, int]:
    """``(repeated, total)`` n-grams of one sequence (see the module docstring)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    total = max(len(tokens) - n + 1, 0)
    for i in range(total):
        gram = tuple(tokens[i : i + n])
        if gram in seen:
            repeated += 1
        seen.add(gram)
    return repeated, total


def repeated_ngram_share(sequences: Iterable[Sequence[int]], n: int = 4) -> float:
    """Pooled share of n-grams that repeat an earlier n-gram of their own sequence (0 if none)."""
    repeated = total = 0
    for seq in sequences:
        r, t = repeated_ngram_counts(seq, n)
        repeated += r
        total += t
    return repeated / total if total else 0.0


def summarize_outputs(outputs: Sequence[_Output]) -> dict[str, Any]:
    """Pooled speculation statistics of one run (one request per output)."""
    steps = sum(o.stats.num_steps for o in outputs)
    drafted = sum(o.stats.num_draft_tokens for o in outputs)
    accepted = sum(o.stats.num_accepted_tokens for o in outputs)
    depth = max((len(o.stats.accepted_per_position) for o in outputs), default=0)
    reached = [0] * depth
    for o in outputs:
        for d, count in enumerate(o.stats.accepted_per_position):
            reached[d] += count
    finish: dict[str, int] = {}
    for o in outputs:
        key = o.finish_reason or "none"
        finish[key] = finish.get(key, 0) + 1
    return {
        "generated_tokens": sum(len(o.token_ids) for o in outputs),
        "num_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "mean_accepted_length": 1.0 + accepted / steps if steps else 0.0,
        "acceptance_per_position": [r / steps for r in reached] if steps else [],
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "finish_reasons": finish,
    }
