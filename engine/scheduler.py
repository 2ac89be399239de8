"""Scheduler: which sequences run this step, and their KV blocks.

Continuous batching: requests join from the waiting queue whenever a batch slot and enough KV
blocks are free, and leave as soon as they finish. Admission reserves every block a request can
need (prompt + max_tokens + one step's draft scratch), so a running request never runs out of
KV memory mid-generation and nothing has to be preempted. Prompts are prefilled in chunks of at
most ``prefill_chunk_tokens`` per step, so running streams keep flowing next to a long prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockOwner, BlockPool
from engine.sequence import SeqStatus, Sequence


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    decode: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_batch_size: int,
        prefill_chunk_tokens: int,
        scratch_tokens: int,
    ) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.scratch_tokens = scratch_tokens  # slots a step may write past the committed ones
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.version = 0  # changes whenever a sequence joins or leaves ``running``
        # A suspect (``Sequence.suspect``) running alone: its steps schedule nothing else, and
        # nothing is admitted meanwhile.
        self.alone: Sequence | None = None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens reserves, one step's draft scratch included."""
        return -(-(num_tokens + self.scratch_tokens) // self.pool.block_size)

    def blocks_needed(self, seq: Sequence) -> int:
        remaining = seq.sampling.max_tokens - seq.num_output_tokens
        return self.blocks_for(len(seq.tokens) + max(remaining, 0))

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_first(self, seq: Sequence) -> None:
        """Queue ``seq`` ahead of every waiting request (a request resumed after a failed step)."""
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        if seq is self.alone:
            self.alone = None
        if seq in self.running:
            self.running.remove(seq)
            self.version += 1
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _admit(self) -> None:
        alone = self.alone
        if alone is not None and alone.stats.num_steps and not alone.quarantined:
            alone.suspect, self.alone = False, None  # the suspect has decoded alone: cleared
        while self.waiting and len(self.running) < self.max_batch_size and self.alone is None:
            seq = self.waiting[0]
            extra = self.blocks_needed(seq) - len(seq.block_ids)
            if extra > self.pool.num_free:
                break  # first come, first served: wait for blocks to free up
            self.waiting.popleft()
            if extra > 0:
                owner = BlockOwner(seq.request_id, seq.owner, seq.session_id)
                seq.block_ids.extend(self.pool.allocate(extra, owner))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.version += 1
            if seq.suspect:
                self.alone = seq

    def schedule(self) -> StepPlan:
        """This step's work: prompt chunks up to the prefill budget, and every other running
        sequence's decode; only the suspect's while one runs alone (the others pause)."""
        self._admit()
        plan = StepPlan()
        budget = self.prefill_chunk_tokens
        for seq in self.running if self.alone is None else [self.alone]:
            if seq.in_prefill:
                if budget <= 0:
                    continue
                todo = seq.num_uncomputed
                chunk = min(todo, budget)
                plan.prefill.append((seq, chunk))
                budget -= chunk
            else:
                plan.decode.append(seq)
        return plan

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
