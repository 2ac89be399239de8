"""One request as the async side sees it: an admission future and a queue of step outputs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


class QueueFull(Exception):
    """The loop's waiting queue is full (HTTP 429)."""


class LoopClosed(Exception):
    """The loop does not take requests now: loading, draining or stopped (HTTP 503)."""


class RequestFailed(Exception):
    """The engine failed while running the request; not the client's fault."""


@dataclass(frozen=True)
class SpecStatsSnapshot:
    """A copy of the request's ``SpecStats`` taken on the engine thread."""

    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    mean_accepted_length: float

    @classmethod
    def from_engine(cls, stats: Any) -> SpecStatsSnapshot | None:
        if stats is None:
            return None
        return cls(
            num_steps=int(stats.num_steps),
            num_draft_tokens=int(stats.num_draft_tokens),
            num_accepted_tokens=int(stats.num_accepted_tokens),
            accepted_per_position=tuple(int(x) for x in stats.accepted_per_position),
            mean_accepted_length=float(stats.mean_accepted_length),
        )


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request, copied so the engine may reuse its objects."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_generated: int
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    stats: SpecStatsSnapshot | None
    # ``new_token_ids``' log-probabilities (``engine.logprobs.TokenLogprob``), where asked for.
    new_logprobs: tuple[Any, ...] | None = None
    # The prompt's (its first token's None), with the turn's first output only.
    prompt_logprobs: tuple[Any, ...] | None = None

    @classmethod
    def from_engine(cls, out: Any) -> StepOutput:
        logprobs = getattr(out, "new_logprobs", None)
        prompt = getattr(out, "prompt_logprobs", None)
        first = out.num_generated == len(out.new_token_ids)
        return cls(
            request_id=out.request_id,
            new_token_ids=tuple(int(t) for t in out.new_token_ids),
            num_generated=out.num_generated,
            finished=bool(out.finished),
            finish_reason=out.finish_reason,
            num_prompt_tokens=int(out.num_prompt_tokens),
            stats=SpecStatsSnapshot.from_engine(getattr(out, "stats", None)),
            new_logprobs=None if logprobs is None else tuple(logprobs),
            prompt_logprobs=tuple(prompt) if prompt is not None and first else None,
        )

    @classmethod
    def aborted(cls, request_id: str) -> StepOutput:
        return cls(request_id, (), 0, True, "abort", 0, None)


class RequestStream:
    """Created on the event loop; fed from the engine thread through ``call_soon_threadsafe``."""

    def __init__(self, request_id: str, aio_loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._aio_loop = aio_loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = aio_loop.create_future()
        # Retrieve the exception even if nobody awaits it (a client that left while queued).
        self.admitted.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.finished = False
        self.num_delivered = 0  # engine thread only: tokens generated in the outputs delivered

    # engine thread ------------------------------------------------------------
    def set_admitted(self, error: BaseException | None) -> None:
        self._threadsafe(self._settle_admitted, error)

    def deliver(self, item: StepOutput | BaseException) -> None:
        self._threadsafe(self._queue.put_nowait, item)

    def _threadsafe(self, fn: Any, arg: Any) -> None:
        try:
            self._aio_loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _settle_admitted(self, error: BaseException | None) -> None:
        if self.admitted.done():
            return
        if error is None:
            self.admitted.set_result(None)
        else:
            self.finished = True
            self.admitted.set_exception(error)

    # event loop ---------------------------------------------------------------
    async def get(self) -> StepOutput:
        """The next output; raises the error the engine thread delivered instead."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
