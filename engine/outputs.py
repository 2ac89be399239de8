"""What the engine hands back: per-request outputs, speculative statistics, zeroing events,
the last step's timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.logprobs import TokenLogprob


@dataclass
class SpecStats:
    """Speculation statistics of one request (see docs/internals.md and DESIGN.md).

    num_steps: target forwards after the prefill (verify steps; autoregressive: decode steps).
    num_draft_tokens: drafted tokens offered for verification, summed over steps.
    num_accepted_tokens: drafted tokens accepted, summed over steps (bonus tokens not counted).
    accepted_per_position[d]: number of steps whose accepted path reached depth d + 1.
    """

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward: 1 + accepted / steps (1.0 before any step)."""
        if self.num_steps == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_steps

    def record_step(self, drafted: int, accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for d in range(accepted):
            self.accepted_per_position[d] += 1


class RequestOutput:
    """What one engine step produced for one request: the ids it added (``new_token_ids``) and
    every id generated so far (``token_ids``, a new list at each read).

    ``token_ids`` is a slice taken when read, not when the step builds the output: the engine
    passes the sequence's own token list, which only ever grows, with ``span`` (start, end) of
    the generated part at this step. Copied at every step, the generated ids of 256 requests of
    1,000 tokens each had cost ~2.4 ms of host time per step on a 2-core CPU (a quadratic cost in
    a request's length); a caller reading ``token_ids`` of the final output only pays it once."""

    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "num_prompt_tokens",
                 "stats", "step_drafted", "step_accepted", "new_logprobs", "prompt_logprobs",
                 "_logprobs", "_tokens", "_span")  # fmt: skip

    def __init__(
        self,
        request_id: str,
        new_token_ids: list[int],
        token_ids: list[int],
        finished: bool,
        finish_reason: str | None,
        num_prompt_tokens: int,
        stats: SpecStats,
        step_drafted: int | None = None,  # drafts offered to this request in this step (None: no verify)
        step_accepted: int | None = None,  # drafts accepted in this step
        *,
        span: tuple[int, int] | None = None,  # the part of ``token_ids`` generated so far (None: all)
        logprobs: list[TokenLogprob] | None = None,  # every generated token's (asked for: else None)
        new_logprobs: list[TokenLogprob] | None = None,  # ``new_token_ids``' (asked for: else None)
        prompt_logprobs: list[TokenLogprob | None] | None = None,  # the prompt's (first: None)
    ) -> None:
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.stats = stats
        self.step_drafted = step_drafted
        self.step_accepted = step_accepted
        self._tokens = token_ids
        self._span = (0, len(token_ids)) if span is None else span
        self._logprobs = logprobs
        self.new_logprobs = new_logprobs
        self.prompt_logprobs = prompt_logprobs

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Every generated token's log-probability and most likely alternatives
        (``SamplingParams.logprobs``; None where not asked for), as ``token_ids``."""
        return None if self._logprobs is None else self._logprobs[: self.num_generated]

    @property
    def token_ids(self) -> list[int]:
        start, end = self._span
        return self._tokens[start:end]

    @property
    def num_generated(self) -> int:
        """``len(token_ids)``, without the copy."""
        start, end = self._span
        return end - start

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, new_token_ids={self.new_token_ids}, "
                f"num_generated={self.num_generated}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r})")


@dataclass(frozen=True)
class ZeroEvent:
    """KV memory of a finished request or closed session was zeroed (for the audit log)."""

    owner: str
    request_id: str | None
    session_id: str | None
    blocks: int
    bytes: int


@dataclass
class StepTimings:
    """Timings of the last step (seconds), for benchmarks.

    ``draft`` and ``verify`` are host clock. On CUDA the rollback (compaction) is timed with CUDA
    events and only resolved when read, so the decode loop never waits for it.
    """

    draft: float = 0.0
    verify: float = 0.0
    rollback_host: float = 0.0
    rollback_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @property
    def rollback(self) -> float:
        if self.rollback_events is None:
            return self.rollback_host
        start, end = self.rollback_events
        end.synchronize()
        return start.elapsed_time(end) / 1e3
