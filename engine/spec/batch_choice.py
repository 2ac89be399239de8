"""Each decode step's draft budget for the engine's batch, cheap where the batch is large.

Adaptive speculation (``AdaptiveController.choose``) weighs the arms from a summary of the
batch: the rows its MTP modules are behind (what a switch to drafting must catch up), the tokens
its sequences may still generate on average (what a switch can win back), and whether any
sequence samples. Reading that summary is a pass over the batch, per-sequence host work that an
autoregressive step at batch 256 does not otherwise pay; so it is carried over autoregressive
steps of an unchanged batch (each puts every sequence one row further behind with one token
fewer left) and re-read only when the batch changes or every ``SUMMARY_REFRESH`` steps, and a
large closed batch that chose autoregressive decoding while behind is latched there until it
changes (``AR_LATCH_MIN_BATCH``). While a batch fills (steps that each prefill a chunk of new
requests), it also answers, once per fill, which drafting arm the new prompts are caught up for
in their prefill (``prompt_catch_up_arm``). Engines without adaptive speculation take their
fixed budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from engine.sequence import Sequence
from engine.spec.adaptive import NO_SPEC
from engine.spec.drafter import TreeBudget, steady_catch_up_rows

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

AR_LATCH_MIN_BATCH = 64  # a closed batch this large decoding autoregressively latches
SUMMARY_REFRESH = 32  # steps an updated batch summary stands before it is re-read


class BatchSummary(NamedTuple):
    """What adaptive speculation reads of a decode batch (``summarize``)."""

    key: tuple[int, int]  # (scheduler version, batch size): the batch it describes
    lag: int  # rows the MTP modules are behind
    left: float  # tokens each sequence may still generate, on average
    sampled: bool
    age: int  # autoregressive steps since it was read from the batch
    exact: bool = False  # re-read after SUMMARY_REFRESH steps: its updates stay exact


def summarize(seqs: list[Sequence], depth: int) -> tuple[int, float, bool]:
    """What the adaptive choice needs, in one pass over the batch (per-step host work grows with
    the batch): rows the MTP modules are behind beyond a steady speculative step's catch-up at
    drafting ``depth`` (the prompts of new requests, the tokens of autoregressive steps), tokens
    each sequence may still generate on average, and whether any sequence samples."""
    slack = steady_catch_up_rows(depth) + 1  # and the pending token
    lag = left = 0
    sampled = False
    for s in seqs:
        n, sampling = len(s.tokens), s.sampling
        behind = n - slack - s.mtp_committed[0]
        if behind > 0:
            lag += behind
        left += sampling.max_tokens - n + s.output_start
        sampled = sampled or not sampling.greedy
    return lag, left / len(seqs), sampled


class BatchChoice:
    """The engine's per-step budget choice and what it carries between steps (the batch
    summary, the latch, the fill's answer)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.summary: BatchSummary | None = None  # after an autoregressive step, for the next
        # A closed batch that chose autoregressive decoding while behind, (scheduler version,
        # batch size, sampled): its steps decode autoregressively with no choice made until the
        # batch changes.
        self.latch: tuple[int, int, bool] | None = None
        # Whether the fill under way (steps that each prefill) has chosen the drafting arm its
        # prompts are caught up for in their prefill, and that arm (None: none): its later
        # chunks follow its first one.
        self._fill_asked = False
        self.fill_arm: TreeBudget | None = None

    def reset(self) -> None:
        """Forget the carried summary, the latch and the fill (statistics reset, a failed step)."""
        self.summary = self.latch = None
        self.end_fill()

    def end_fill(self) -> None:
        """A step without a prefill: the fill under way, if any, has ended."""
        self._fill_asked, self.fill_arm = False, None

    def prompt_catch_up_arm(
        self, prefilled: list[Sequence], whole_chunk: bool, last_drafting: TreeBudget | None
    ) -> TreeBudget | None:
        """The drafting arm the MTP modules are caught up for over the prompts of ``prefilled``
        in their prefill (it just ended; ``whole_chunk``: every sequence of the step's prefill
        did), so that their first decode step can already take a device step; None: left to
        their first drafting step. ``last_drafting``: the last decode step's budget if it
        drafted.

        Engines without adaptive speculation catch up for their budget. Adaptive ones leave it
        to the first speculative step (where autoregressive decoding wins it is never paid, and
        while a batch fills its choice weighs the catch-up), unless their last decode step
        drafted and nothing else is joining the batch (a request arriving alone at a drafting
        batch), or the batch being filled would draft once full, its catch-up counted
        (``filled_batch_drafts``). (Caught up in every prefill, the H200's closed batch of 256
        drafted as it filled, its catch-ups uncounted: 0.85x autoregressive decoding.)"""
        engine = self.engine
        if engine.adaptive is None:
            return engine.budget
        # Alone: nothing waits and no other request is still in its prefill (a batch admitted
        # at once fills over several chunks: caught up at its first, the H200's batch 256
        # drafted at 64, 128 and 192 sequences, catching each chunk up in turn, then decoded
        # autoregressively: 19 ms of a 160 ms round for nothing). And the batch it joins has
        # been decoding: after a prefill-only step the last decode step's choice is another
        # batch's (the H200's batch 128 fills in two chunks: its second was caught up or not as
        # the previous batch's last step had drafted, and if not, the first drafting step
        # caught 64 prompts up in ~6.5 ms, against ~2.3 ms in the prefill). (Sequences in
        # prefill have taken no decode step: ``num_steps`` counts a turn's.)
        # Asked once per fill: its later chunks follow its first, whatever the last decode step
        # chose. A fill that drafts after its first chunks and leaves its last to the first
        # full step pays that catch-up there (the H200's batch 256: a filling step decoded
        # autoregressively, so its last chunk, "alone", was not caught up, and the first full
        # step took 22 ms against ~6); and each question reads the whole batch (~0.3 ms at
        # 256), as "alone" does (so it is read only for the question).
        if not self._fill_asked:
            scheduler = engine.scheduler
            just = set(map(id, prefilled))  # in prefill until their first tokens, read next
            alone = (not scheduler.num_waiting and whole_chunk
                     and not any(s.in_prefill for s in scheduler.running if id(s) not in just)
                     and any(s.stats.num_steps for s in scheduler.running))  # fmt: skip
            self._fill_asked = True
            self.fill_arm = last_drafting if alone else self.filled_batch_drafts()
        return self.fill_arm

    def choose(
        self, seqs: list[Sequence], filling: bool = False, closed: bool = False
    ) -> tuple[TreeBudget, int, bool]:
        """This step's budget for decoding ``seqs``, the rows the MTP modules are behind, and
        whether any sequence samples (the last two only for adaptive speculation).
        ``filling``: requests are being prefilled in this step (they join the batch);
        ``closed``: none is waiting or in prefill.

        After an autoregressive step over the same batch the summary is updated, not re-read
        (every sequence one row further behind, one token fewer left). It is re-read every
        ``SUMMARY_REFRESH`` steps (the update over-counts the rows of sequences within a steady
        step's catch-up slack), once: by then every sequence is past its slack, and each
        autoregressive step adds exactly one row per sequence (the re-read of 256 sequences
        every 32 steps cost ~11 us a step on a 2-core host)."""
        engine = self.engine
        adaptive = engine.adaptive
        if adaptive is None:
            return engine.budget, 0, False
        key = (engine.scheduler.version, len(seqs))
        latch = self.latch
        if latch is not None and not filling and latch[:2] == key:
            adaptive.steps_per_arm[NO_SPEC] += 1
            return NO_SPEC, 0, latch[2]
        self.latch = None
        summary = self.summary
        if summary is None or summary.key != key or (summary.age >= SUMMARY_REFRESH and not summary.exact):
            summary = BatchSummary(key, *summarize(seqs, engine.budget.depth), age=0,
                                   exact=summary is not None and summary.key == key)  # fmt: skip
        filled = None
        if filling:  # the batch it is headed for: running (prefilling too) and waiting requests
            scheduler = engine.scheduler
            filled = min(len(scheduler.running) + scheduler.num_waiting, engine.config.max_batch_size)
        budget = adaptive.choose(
            engine, len(seqs), summary.sampled, summary.lag, summary.left, filling, closed, filled_batch=filled
        )
        self.summary = None if budget.speculates else summary._replace(
            lag=summary.lag + len(seqs), left=summary.left - 1, age=summary.age + 1
        )
        if (not budget.speculates and closed and not filling and summary.lag > 0
                and len(seqs) >= AR_LATCH_MIN_BATCH and adaptive.forced is None):  # fmt: skip
            # Latched: a large closed batch behind its MTP modules that decodes
            # autoregressively stays so until it changes (a sequence finishes): each step puts
            # it one row per sequence further behind with one token fewer left, so a switch
            # only pays less. Its steps then skip the batch summary and the choice (the H200's
            # batch 256 decoding autoregressively ran 3% (greedy) and 7% (T=0.7) slower than
            # the baseline, its steps host-bound, session 33). They are still measured: left to
            # the dear steps around a batch change, the autoregressive cost rose to 1.9 ms at
            # batch 256, and batches of 64-256 drafted where they lost. Small batches keep
            # choosing: their choice costs little, and a run there re-measures a yield cheaply
            # (``MeasuredArms._relearn``).
            self.latch = (*key, summary.sampled)
        return budget, summary.lag, summary.sampled

    def filled_batch_drafts(self) -> TreeBudget | None:
        """The drafting arm the batch being filled (the running sequences and those waiting, up
        to the batch limit) would switch to once full, its MTP catch-up over every prompt
        counted (``AdaptiveController.drafting_arm``); None if it would decode
        autoregressively. Where it drafts, each prefill chunk's prompts are caught up as they
        are prefilled: on the H200 64 prompts of 64 tokens took ~3 ms more in their prefill,
        against ~16 ms for the catch-up of 256 in the drafting step after the fill."""
        engine = self.engine
        assert engine.adaptive is not None
        scheduler = engine.scheduler
        seqs = [*scheduler.running, *scheduler.waiting][: engine.config.max_batch_size]
        if not seqs:  # the prefill's first tokens ended every request (a stop id, max_tokens 1)
            return None
        lag, left, sampled = summarize(seqs, engine.budget.depth)
        return engine.adaptive.drafting_arm(engine, len(seqs), sampled, lag, left, engine.closed_workload)
