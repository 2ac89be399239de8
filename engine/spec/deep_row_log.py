"""DeepRowLog: the inputs of the MTP modules a graphed step skipped, kept until one needs them.

A graphed step that drafts ``D`` depths with a model of ``k > D`` MTP modules needs modules
``1..D`` only (``SpecConfig.lazy_deep_modules``: adaptive speculation's chain arm, 4 deep on
the six-module ``gpu`` preset, had run modules 5 and 6 over its catch-up rows in every step,
for other arms). It then leaves module ``D + 1`` behind: its inputs, module ``D``'s outputs over
the rows each step commits, are logged here per step ([n, C, H] and each sequence's count), and
handed to the sequences (``Sequence.push_hidden(D, ...)``) only when something reads their
deeper modules: a catch-up (``MTPDrafter.catch_up``), a step of an arm that drafts with them, a
session's next prefill, a failed step's recovery. A batch that stays on the chain hands out
nothing, and its deeper modules catch up only if an arm that drafts with them comes next.

Invariant: a sequence's logged rows of depth ``d`` continue its depth-``d`` queue
(``pending_start[d]`` + the rows it holds) in step order; nothing else appends to that queue
while rows are logged, since every reader of the deeper modules flushes first.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.host_tensor import to_device
from engine.sequence import SeqStatus, Sequence

MAX_LOGGED_STEPS = 64  # steps kept before the rows are handed out (bounds the device memory held)


class _Run:
    """Consecutive steps of one runner over the same batch: each step's rows [n, C, H], and
    per step and sequence the count of valid rows and the hidden index of the first."""

    def __init__(self, depth: int, seqs: tuple[Sequence, ...]) -> None:
        self.depth, self.seqs = depth, seqs
        self.rows: list[torch.Tensor] = []
        self.counts: list[list[int]] = []
        self.starts: list[list[int]] = []


class DeepRowLog:
    def __init__(self, max_steps: int = MAX_LOGGED_STEPS) -> None:
        self.max_steps = max_steps
        self._runs: list[_Run] = []
        self._count = 0
        self._logged: set[int] = set()  # ids of the sequences in the runs (kept alive by them)

    def __len__(self) -> int:
        return self._count

    def append(
        self, depth: int, seqs: list[Sequence], rows: torch.Tensor, counts: list[int], starts: list[int]
    ) -> None:
        """Log one step: ``rows[i, :counts[i]]`` [n, C, H] are ``seqs[i]``'s depth-``depth``
        hidden states for indices ``starts[i] ...`` (module ``depth``'s outputs over its rows)."""
        last = self._runs[-1] if self._runs else None
        if (last is None or last.depth != depth or last.rows[0].shape[1] != rows.shape[1]
                or last.seqs != tuple(seqs)):  # fmt: skip
            last = _Run(depth, tuple(seqs))
            self._runs.append(last)
            self._logged.update(map(id, seqs))
        last.rows.append(rows)
        last.counts.append(counts)
        last.starts.append(starts)
        self._count += 1
        if self._count >= self.max_steps:
            self.flush()

    def holds(self, seq: Sequence) -> bool:
        """Whether rows of ``seq`` are logged (not yet handed out)."""
        return id(seq) in self._logged

    def clear(self) -> None:
        """Forget every logged row (every logged sequence has finished)."""
        self._runs.clear()
        self._logged.clear()
        self._count = 0

    def flush(self) -> None:
        """Hand every logged row to its sequence's queue (finished sequences' are dropped): per
        run, one gather for all its sequences and one push per sequence."""
        runs, self._runs = self._runs, []
        self._logged.clear()
        self._count = 0
        for run in runs:
            live = [i for i, s in enumerate(run.seqs) if s.status is not SeqStatus.FINISHED]
            if not live:
                continue
            counts = np.asarray(run.counts)[:, live]  # [steps, L]
            starts = np.asarray(run.starts)[:, live]  # [steps, L]
            if not (starts[1:] == starts[:-1] + counts[:-1]).all():
                raise AssertionError("deep rows logged out of order")
            n, width = len(run.seqs), run.rows[0].shape[1]
            steps = len(run.rows)
            # Flat row of (step e, sequence i, row j) in the steps' rows concatenated: e*n*C + i*C + j.
            grid = (np.arange(steps)[:, None, None] * n * width + np.asarray(live)[None, :, None] * width
                    + np.arange(width)[None, None, :])  # [steps, L, C]  # fmt: skip
            valid = np.arange(width)[None, None, :] < counts[:, :, None]  # [steps, L, C]
            order = grid.transpose(1, 0, 2)[valid.transpose(1, 0, 2)]  # sequence by sequence, oldest first
            flat = torch.cat(run.rows).flatten(0, 1)  # [steps * n * C, H]
            picked = flat.index_select(0, to_device(torch.from_numpy(order), flat.device))
            parts = picked.split(counts.sum(axis=0).tolist())
            for i, part, start in zip(live, parts, starts[0].tolist(), strict=True):
                if part.shape[0]:
                    run.seqs[i].push_hidden(run.depth, start, part)
