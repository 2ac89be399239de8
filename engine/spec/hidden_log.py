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
tokens while rows are logged (the engine flushes before any prefill or speculative step), and
an autoregressive step never truncates what it committed, so a sequence with ``n`` logged rows
holds them for hidden indices ``num_committed - n .. num_committed - 1``.
"""

from __future__ import annotations

import torch

from engine.sequence import SeqStatus, Sequence

MAX_LOGGED_STEPS = 256  # steps kept before the rows are handed out (bounds the memory held)


class HiddenLog:
    def __init__(self, max_steps: int = MAX_LOGGED_STEPS) -> None:
        self.max_steps = max_steps
        self._steps: list[tuple[tuple[Sequence, ...], torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def append(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Log one autoregressive step: row i of ``hidden`` [B, H] is ``seqs[i]``'s newest
        committed position (count it committed before the next flush)."""
        self._steps.append((tuple(seqs), hidden))
        if len(self._steps) >= self.max_steps:
            self.flush()

    def flush(self) -> None:
        """Hand every logged row to its sequence's MTP queue (finished sequences' are dropped)."""
        if not self._steps:
            return
        rows_of: dict[Sequence, list[int]] = {}
        offset = 0
        for seqs, _ in self._steps:
            for i, seq in enumerate(seqs):
                rows = rows_of.get(seq)
                if rows is None:
                    rows_of[seq] = [offset + i]
                else:
                    rows.append(offset + i)
            offset += len(seqs)
        live = [(s, rows) for s, rows in rows_of.items() if s.status is not SeqStatus.FINISHED]
        if live:
            hidden = [h for _, h in self._steps]
            flat = hidden[0] if len(hidden) == 1 else torch.cat(hidden)  # [R, H]
            index = torch.tensor([r for _, rows in live for r in rows], device=flat.device)
            parts = flat.index_select(0, index).split([len(rows) for _, rows in live])
            for (seq, rows), part in zip(live, parts, strict=True):
                seq.push_hidden(0, seq.num_committed - len(rows), part)
        self._steps.clear()
