"""Decode steps launched ahead of their turn (``EngineConfig.overlap_steps``).

A steady decode step's successor is queued on the device as soon as the step's outputs are read,
before the host's work on them (commits, stop checks, outputs, the next scheduling), so the
device runs one while the host does the other, as vLLM's asynchronous scheduling and SGLang's
overlap scheduler do. The successor is launched over the whole batch: a sequence that stops in
the step rides along (its blocks, released when it stops, are zeroed after the successor in
stream order) and its row is not read. The next engine step reads the successor over the
sequences of its batch still decoding (``rows_within``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.sequence import Sequence


class ARLaunch(NamedTuple):
    """An autoregressive step queued on the device and not yet read."""

    seqs: list[Sequence]  # its batch, in row order
    hidden: torch.Tensor  # [B, H] the new positions' hidden states
    tokens: torch.Tensor  # [B] drawn on the device
    ok: torch.Tensor | None  # [B] bool: each sampled row had probability mass (None: greedy)


def rows_within(seqs: list[Sequence], launched: list[Sequence]) -> list[int]:
    """The row of each of ``seqs`` in ``launched``, of which they are a subsequence (the
    launched batch, or those of it still decoding)."""
    if len(seqs) == len(launched):
        if any(a is not b for a, b in zip(seqs, launched, strict=True)):
            raise ValueError("a step launched ahead must be read over its own batch")
        return list(range(len(seqs)))
    rows, i = [], 0
    for s in seqs:
        while i < len(launched) and launched[i] is not s:
            i += 1
        if i == len(launched):
            raise ValueError("a step launched ahead must be read over its own batch (or part of it, in order)")
        rows.append(i)
        i += 1
    return rows


def may_continue(seqs: list[Sequence], past_committed: int) -> bool:
    """Whether any of ``seqs``, whose step was just read but not yet appended (each then holds
    ``num_committed + past_committed`` tokens), may take another: not all reach ``max_tokens``."""
    return any(s.num_committed + past_committed - s.output_start < s.sampling.max_tokens for s in seqs)
