"""The target's hidden states of autoregressive steps, kept per step until the MTP modules need them.

An engine that may draft (adaptive speculation) keeps, for every committed token, the target's
last hidden state: module 1 consumes it when it catches up (``Sequence.push_hidden``). Handing
each row to its sequence at every autoregressive step is per-sequence host work the
autoregressive baseline does not do, and at large batches, where adaptive speculation decodes
autoregressively, that work is what its steps cost beyond the baseline's. So an autoregressive
step appends its whole output once ([B, H], with the batch's sequences); the rows are handed
out only when something reads a sequence's MTP state (a speculative step, a prefill that
continues a session) or the log is full: one gather for all sequences, and nothing at all for
the rows of sequences that finish first.

Invariant: a sequence's logged rows are its newest committed positions. Nothing else commits
its tokens while they are logged (the engine flushes before any speculative step, and before a
prefill of a sequence the log holds: a session's next turn), and
an autoregressive step never truncates what it committed, so a sequence with ``n`` logged rows
holds them for hidden indices ``num_committed - n .. num_committed - 1``.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from engine.host_tensor import to_device
from engine.sequence import SeqStatus, Sequence

MAX_LOGGED_STEPS = 256  # steps kept before the rows are handed out (bounds the memory held)


class HiddenLog:
    def __init__(self, max_steps: int = MAX_LOGGED_STEPS) -> None:
        self.max_steps = max_steps
        # Runs of consecutive steps over the same batch: (its sequences, each step's [B, H]).
        # A closed batch decoding autoregressively is one run until a sequence finishes, so the
        # flush's host work grows with the batches seen, not with the rows (a flush of 64 steps
        # of 256 finished sequences took 2.5 ms of a 2-core host's time row by row).
        self._runs: list[tuple[tuple[Sequence, ...], list[torch.Tensor]]] = []
        self._count = 0
        # ids of the sequences in the runs (the runs keep them alive, so no id is reused)
        self._logged: set[int] = set()
        self._last_key: Hashable | None = None  # the caller's key of the last run's batch

    def __len__(self) -> int:
        return self._count

    def append(self, seqs: list[Sequence], hidden: torch.Tensor, key: Hashable | None = None) -> None:
        """Log one autoregressive step: row i of ``hidden`` [B, H] is ``seqs[i]``'s newest
        committed position (count it committed before the next flush). ``key``: what the
        caller knows the batch by (the engine's scheduler version and batch size), equal for
        two steps only if their ``seqs`` are the same sequences in the same order: the step
        then joins the last run without comparing the batch sequence by sequence (~20 us a
        step at batch 256 on a 2-core host)."""
        if self._joins_last_run(seqs, key):
            self._runs[-1][1].append(hidden)
        else:
            batch = tuple(seqs)
            self._runs.append((batch, [hidden]))
            self._logged.update(map(id, batch))
        self._last_key = key
        self._count += 1
        if self._count >= self.max_steps:
            self.flush()

    def _joins_last_run(self, seqs: list[Sequence], key: Hashable | None) -> bool:
        """Whether ``seqs`` is the last run's batch: by the caller's key (its ends checked too),
        else sequence by sequence (Sequence compares by identity)."""
        if not self._runs:
            return False
        last = self._runs[-1][0]
        if key is None:
            return last == tuple(seqs)
        return key == self._last_key and len(last) == len(seqs) and last[0] is seqs[0] and last[-1] is seqs[-1]

    def holds(self, seq: Sequence) -> bool:
        """Whether rows of ``seq`` are logged (not yet handed out)."""
        return id(seq) in self._logged

    def clear(self) -> None:
        """Forget every logged row: for when every logged sequence has finished (the engine is
        idle), whose rows a flush would drop anyway. Kept, they hold device memory and fill the
        log, whose flush then concatenates them all: closed batches of 256 decoding
        autoregressively one after another left 64 steps of rows each, and the flush every 256
        steps took ~20 ms of a 2-core host."""
        self._runs.clear()
        self._logged.clear()
        self._count = 0
        self._last_key = None

    def flush(self) -> None:
        """Hand every logged row to its sequence's MTP queue (finished sequences' are dropped):
        one gather for all of them."""
        if not self._runs:
            return
        rows_of: dict[Sequence, list[torch.Tensor]] = {}  # flat row indices, oldest first
        steps: list[torch.Tensor] = []
        offset = 0
        for batch, hidden in self._runs:
            width = len(batch)
            live = [i for i, s in enumerate(batch) if s.status is not SeqStatus.FINISHED]
            if live:
                step_rows = offset + torch.arange(len(hidden)) * width  # [n] row 0 of each step
                rows = torch.tensor(live)[:, None] + step_rows[None, :]  # [L, n]
                for i, seq_rows in zip(live, rows, strict=True):
                    rows_of.setdefault(batch[i], []).append(seq_rows)
            steps += hidden
            offset += len(hidden) * width
        if rows_of:
            flat = steps[0] if len(steps) == 1 else torch.cat(steps)  # [R, H]
            per_seq = [(seq, idx[0] if len(idx) == 1 else torch.cat(idx)) for seq, idx in rows_of.items()]
            index = to_device(torch.cat([idx for _, idx in per_seq]), flat.device)
            parts = flat.index_select(0, index).split([len(idx) for _, idx in per_seq])
            for (seq, idx), part in zip(per_seq, parts, strict=True):
                seq.push_hidden(0, seq.num_committed - len(idx), part)
        self.clear()
