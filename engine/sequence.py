"""Sequence: the engine-side state of one request (or of one session across its turns).

Token bookkeeping (docs/internals.md): ``tokens[:num_committed]`` have target KV entries;
``tokens[num_committed:]`` still have to run through the target (the prompt during prefill, the
single pending token while decoding).

MTP state: module d (1-based) has KV entries for hidden indices ``0 .. mtp_committed[d-1] - 1``.
Its row at hidden index t consumes the depth-(d-1) hidden state at t and token ``x_{t+d}``.
``pending_hidden[d]`` holds depth-d hidden states (d = 0: the target's) that module d+1 has not
consumed yet, starting at hidden index ``pending_start[d]``. After a graphed speculative step
the rows are ``deferred``: they stay in the step's output tensors until something reads or
changes the queue (every access goes through ``hidden_rows`` / ``take_hidden`` /
``push_hidden``), so a step over the same batch hands out no per-sequence tensor views.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.logprobs import TokenLogprob
from engine.outputs import SpecStats
from engine.params import SamplingParams

MAX_HIDDEN_TAIL = 256  # appended row groups kept apart before they are concatenated


class DeferredHidden(Protocol):
    """Where a sequence's pending MTP rows stay until read (a graphed step's outputs)."""

    def hidden_of(self, index: int) -> list[torch.Tensor]:
        """Sequence ``index``'s pending rows per depth 0..k-1 (``pending_hidden``'s entries)."""
        ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    IDLE = "idle"  # a session between turns: keeps tokens and blocks


@dataclass(eq=False)  # identity: a batch finds and removes its sequences without comparing fields
class Sequence:
    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    owner: str = ""
    session_id: str | None = None
    num_mtp_modules: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_committed: int = 0
    output_start: int = 0  # index in tokens where this turn's generated tokens begin
    num_prompt_tokens: int = 0  # prompt tokens of this turn
    block_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    # The ids that would end this turn's output (EOS, stop ids), kept from being drawn while it
    # is shorter than its sampling's min_tokens (empty without one).
    ends: tuple[int, ...] = ()
    # This turn's generated tokens' log-probabilities, where its sampling asks for them.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # This turn's prompt tokens' (None for its first), where its sampling asks for them.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    mtp_committed: list[int] = field(default_factory=list)
    pending_hidden: list[torch.Tensor | None] = field(default_factory=list)
    pending_start: list[int] = field(default_factory=list)
    # Adaptive speculation: the engine's drafting-step clock (steps, summed mean yields) and this
    # sequence's accepted tokens when it started decoding (``LLMEngine._observe_yield``).
    yield_clock: tuple[int, float, int] | None = None
    # (source, index): ``pending_hidden`` is ``source.hidden_of(index)``, not yet handed out.
    deferred: tuple[DeferredHidden, int] | None = None
    # A failed engine step's batch (``engine.step_failure``, ``LLMEngine.resume_request``): a
    # resumed request is a ``suspect`` that runs with no other sequence until it has decoded a
    # step; resumed a second time (``resumed`` already), ``quarantined``: alone until it ends.
    resumed: bool = False
    suspect: bool = False
    quarantined: bool = False

    def new_turn(self) -> None:
        """A session's next request: a failed step of an earlier turn counts against none."""
        self.resumed = self.suspect = self.quarantined = False
        self.logprobs = []
        self.prompt_logprobs = []

    def __post_init__(self) -> None:
        self._fresh_mtp_state()

    def _fresh_mtp_state(self) -> None:
        k = self.num_mtp_modules
        self.mtp_committed = [0] * k
        self.pending_hidden = [None] * k
        self.pending_start = [0] * k
        self.deferred = None
        # Row groups [n, H] appended since the last read.
        self._hidden_tail: list[list[torch.Tensor]] = [[] for _ in range(k)]
        self._tail_end = [0] * k  # hidden index after the tail's last row (while it has rows)

    def forget_computation(self) -> None:
        """Nothing computed any more: no target KV entry, no MTP state; every token is read
        again from the start (the caller releases the KV blocks). For a session whose state a
        failed engine step may have left half-written (``LLMEngine.step``)."""
        self.num_committed = 0
        self._fresh_mtp_state()

    # ---- views ----
    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.output_start :]

    @property
    def num_output_tokens(self) -> int:
        """``len(output_ids)``, without the copy."""
        return len(self.tokens) - self.output_start

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_committed

    @property
    def in_prefill(self) -> bool:
        """True while more than the single pending token still has to run through the target."""
        return self.num_uncomputed > 1 or len(self.tokens) == self.output_start

    # ---- MTP hidden-state queue ----
    @property
    def has_hidden_tail(self) -> bool:
        """Rows were appended since the queue was last read (``hidden_rows`` folds them in)."""
        return any(self._hidden_tail)

    def _undefer(self) -> None:
        """Hand out the deferred rows (``deferred``) as ``pending_hidden``'s entries."""
        if self.deferred is not None:
            source, index = self.deferred
            self.deferred = None
            self.pending_hidden[:] = source.hidden_of(index)  # the whole queue of every depth
            for tail in self._hidden_tail:
                tail.clear()

    def push_hidden(self, depth: int, start: int, rows: torch.Tensor) -> None:
        """Append depth-``depth`` hidden rows [n, H] for hidden indices start .. start+n-1.

        Appending is O(1) host work: rows join a tail concatenated when next read
        (``hidden_rows``); a long tail is folded in now and then. (Autoregressive steps do not
        append per sequence at all: ``engine.spec.hidden_log``.)"""
        if depth >= self.num_mtp_modules:
            return  # the last module's outputs feed nobody
        self._undefer()
        tail = self._hidden_tail[depth]
        if not tail:
            current = self.pending_hidden[depth]
            if current is None or current.shape[0] == 0:
                self.pending_hidden[depth] = rows
                self.pending_start[depth] = start
                return
            self._tail_end[depth] = self.pending_start[depth] + current.shape[0]
        assert self._tail_end[depth] == start, "hidden rows out of order"
        tail.append(rows)
        self._tail_end[depth] = start + rows.shape[0]
        if len(tail) >= MAX_HIDDEN_TAIL:
            self.hidden_rows(depth)

    def hidden_rows(self, depth: int) -> torch.Tensor | None:
        """Depth-``depth`` rows module ``depth + 1`` has not consumed yet (from ``pending_start``)."""
        self._undefer()
        tail = self._hidden_tail[depth]
        if tail:
            current = self.pending_hidden[depth]
            parts = [current] if current is not None and current.shape[0] else []
            self.pending_hidden[depth] = torch.cat(parts + tail, dim=0)
            tail.clear()
        return self.pending_hidden[depth]

    def take_hidden(self, depth: int, upto: int) -> tuple[int, torch.Tensor | None]:
        """Remove and return depth-``depth`` rows with hidden index <= upto: (start, rows)."""
        rows = self.hidden_rows(depth)
        start = self.pending_start[depth]
        if rows is None or upto < start:
            return start, None
        count = min(rows.shape[0], upto - start + 1)
        taken, rest = rows[:count], rows[count:]
        self.pending_hidden[depth] = rest
        self.pending_start[depth] = start + count
        return start, taken
