"""One generation request from admission to its last token, shared by every route.

``start()`` takes the tenant's quota lease, queues the request on the engine loop and waits for
the engine to accept it (so input errors still get a 4xx status). ``deltas()`` yields text as it
is detokenised and cut at stop strings. ``close()`` is synchronous (it runs in ``finally`` blocks
of cancelled streams): it aborts an unfinished request, which frees and zeroes its KV before the
next step, returns the lease, and records metrics and the request log line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from app.errors import APIError, ClientGone, bad_request, too_many, unavailable
from app.logging import REQUEST_LOGGER
from app.quotas import Lease, QuotaExceeded
from app.schemas import PromptTokensDetails, SpecUsage, Usage
from app.service import Service
from app.sessions import SessionRecord
from app.stop_strings import IncrementalDetokenizer, StopMatcher
from app.tenants import Tenant
from engine.logprobs import TokenLogprob
from engine.outputs import SpecStats
from engine.params import SamplingParams
from engine.serving import LoopClosed, QueueFull, RequestFailed, RequestStream, StepOutput

log = logging.getLogger(REQUEST_LOGGER)
_POLL_S = 0.1


@dataclass
class GenerationInput:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stops: list[str]
    session: SessionRecord | None = None
    history_tokens: int = 0  # the session's tokens before this turn
    cached_tokens: int = 0  # of those, the ones whose KV entries the turn reuses
    prompt_text: str | None = None  # kept only for debug logging (MTPSERVE_LOG_TEXT)
    echo: str | None = None  # text sent before the completion's (``echo``: the prompt's)


async def until_done_or_disconnect(request: Request, awaitable: Any) -> Any:
    """Await ``awaitable``; raise ClientGone (cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


class Generation:
    def __init__(self, service: Service, tenant: Tenant, inp: GenerationInput, prefix: str) -> None:
        self.service = service
        self.tenant = tenant
        self.inp = inp
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.stream: RequestStream | None = None
        self.lease: Lease | None = None
        self.finish_reason: str | None = None
        self.status = "abort"
        self.completion_tokens = 0
        self.stats: Any = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        # The generated tokens' log-probabilities (where the request asks for them), and those
        # not yet handed to the stream (``take_logprobs``).
        self.logprobs: list[TokenLogprob] = []
        self._unsent_logprobs: list[TokenLogprob] = []
        # With ``echo``: the prompt's (its first token's log-probability NaN: no context).
        self.prompt_logprobs: list[TokenLogprob] = []
        self._closed = False
        tok = service.engine.tokenizer
        self._detok = IncrementalDetokenizer(tok, inp.prompt_token_ids) if tok else None
        self._stops = StopMatcher(inp.stops)

    # ---------------------------------------------------------------- admission
    async def start(self, request: Request) -> None:
        await self.submit()
        await self.wait_admitted(request)

    async def submit(self) -> None:
        """Take the tenant's quota lease and queue the request on the engine loop (at once;
        ``wait_admitted`` waits for the engine to accept it)."""
        svc, inp = self.service, self.inp
        prompt_len = len(inp.prompt_token_ids)
        kv_tokens = inp.history_tokens + prompt_len + inp.sampling.max_tokens
        idle = svc.sessions.idle_tokens(self.tenant.name)
        try:
            self.lease = svc.quotas.acquire(
                self.tenant, prompt_tokens=prompt_len, kv_tokens=kv_tokens, idle_session_tokens=idle
            )
        except QuotaExceeded as exc:
            self._count("rate_limited")
            raise too_many(exc.message, exc.retry_after, "quota_exceeded") from None
        if inp.session is not None:
            inp.session.busy = True
        try:
            self.stream = await svc.loop.submit(
                self.request_id,
                inp.prompt_token_ids,
                inp.sampling,
                session_id=inp.session.id if inp.session else None,
                owner=self.tenant.name,
            )
        except BaseException as exc:
            self.close()
            raise self._admission_error(exc) from None

    async def wait_admitted(self, request: Request) -> None:
        """Wait for the engine to accept the submitted request (its input errors are 4xx)."""
        assert self.stream is not None
        try:
            await until_done_or_disconnect(request, asyncio.shield(self.stream.admitted))
        except BaseException as exc:
            self.close()
            raise self._admission_error(exc) from None

    def _admission_error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, QueueFull):
            self._count("rate_limited")
            return too_many("the server is busy: the waiting queue is full", 1.0, "queue_full")
        if isinstance(exc, LoopClosed):
            self._count("unavailable")
            return unavailable("the server is not accepting requests", "not_ready")
        if isinstance(exc, ValueError):  # engine input validation, KVCacheFull included
            self._count("invalid")
            message = _engine_message(exc)
            param = "prompt" if self.inp.session is None else "session"
            if message.startswith("logit_bias"):
                param = "logit_bias"
            return bad_request(message, param, "invalid_request")
        if isinstance(exc, RequestFailed):
            self._count("error")
            return APIError(500, "the engine failed while starting the request", code="engine")
        self._count("abort")  # ClientGone, CancelledError: propagate as they are
        return exc

    # ---------------------------------------------------------------- generation
    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces as they become final; sets finish_reason at the end."""
        assert self.stream is not None
        echo = self.inp.echo
        while self.finish_reason is None:
            out: StepOutput = await self.stream.get()
            text = self._take(out)
            if echo is not None:  # with the first output, which brings the prompt's logprobs
                text, echo = echo + text, None
            if self._stops.stopped:
                self.finish_reason = "stop"
                self.service.loop.abort(self.request_id)
            elif out.finished:
                self.finish_reason = out.finish_reason or "stop"
                text += self._stops.push(self._detok.flush() if self._detok else "")
                text += self._stops.flush()
            if text:
                self.text_parts.append(text)
                yield text

    def _take(self, out: StepOutput) -> str:
        if out.new_token_ids:
            now = time.perf_counter()
            metrics = self.service.metrics
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
            elif self.last_token_at is not None:
                metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        if out.prompt_logprobs is not None and not self.prompt_logprobs:
            first = TokenLogprob(self.inp.prompt_token_ids[0], math.nan, ())
            self.prompt_logprobs = [first, *out.prompt_logprobs[1:]]
            self._unsent_logprobs[:0] = self.prompt_logprobs
        if out.finish_reason != "abort":
            self.token_ids.extend(out.new_token_ids)
            if out.new_logprobs:
                self.logprobs.extend(out.new_logprobs)
                self._unsent_logprobs.extend(out.new_logprobs)
            self.completion_tokens = max(self.completion_tokens, out.num_generated)
            self.stats = out.stats or self.stats
        if self._detok is None:
            return ""
        return self._stops.push(self._detok.push(out.new_token_ids))

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities received since the last call (a stream sends them with the
        text that follows: a token's text may wait for the next token's); None where the
        request did not ask for them."""
        if self.inp.sampling.logprobs is None:
            return None
        taken, self._unsent_logprobs = self._unsent_logprobs, []
        return taken

    # ---------------------------------------------------------------- results
    def usage(self) -> Usage:
        cached = self.inp.cached_tokens if self.inp.session is not None else None
        return build_usage(
            len(self.inp.prompt_token_ids), self.completion_tokens, self.stats, cached
        )

    def close(self, error: bool = False) -> None:
        """Idempotent; safe in ``finally`` of a cancelled task (never awaits)."""
        if self._closed:
            return
        self._closed = True
        svc, tenant = self.service, self.tenant.name
        if self.stream is not None and not self.stream.finished:
            svc.loop.abort(self.request_id)
        if self.lease is not None:
            svc.quotas.release(self.lease)
            svc.quotas.add_tokens(tenant, self.completion_tokens)
        session = self.inp.session
        if session is not None:
            session.busy = False
            svc.sessions.touch(session)
            if self.stream is not None and self.stream.admitted.done():
                admitted_ok = not self.stream.admitted.exception()
                if admitted_ok:
                    used = len(self.inp.prompt_token_ids) + self.completion_tokens
                    session.num_tokens = self.inp.history_tokens + used
        if self.stream is None or not self.stream.admitted.done():
            return  # rejected before admission: already counted
        if self.stream.admitted.exception() is not None:
            return
        self._observe_end(error)

    def _observe_end(self, error: bool) -> None:
        m, tenant = self.service.metrics, self.tenant.name
        now = time.perf_counter()
        if error:
            self.status = "error"
        elif self.finish_reason in ("stop", "length"):
            self.status = self.finish_reason
        self._count(self.status)
        m.prompt_tokens.labels(tenant=tenant).inc(len(self.inp.prompt_token_ids))
        m.completion_tokens.labels(tenant=tenant).inc(self.completion_tokens)
        if self.status in ("stop", "length"):
            m.e2e.observe(now - self.arrival)
            if self.first_token_at is not None and self.completion_tokens > 1:
                assert self.last_token_at is not None
                span = self.last_token_at - self.first_token_at
                m.tpot.observe(span / (self.completion_tokens - 1))
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "tenant": tenant,
            "status": self.status,
            "prompt_tokens": len(self.inp.prompt_token_ids),
            "cached_tokens": self.inp.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.first_token_at is None else self.first_token_at - self.arrival,
            "e2e_s": now - self.arrival,
            "session": self.inp.session is not None,
        }
        if self.service.settings.log_text:
            fields["prompt_text"] = self.inp.prompt_text
            fields["completion_text"] = "".join(self.text_parts)
        log.info("request finished", extra={"fields": fields})

    def _count(self, status: str) -> None:
        self.service.metrics.requests.labels(tenant=self.tenant.name, status=status).inc()


def build_usage(prompt: int, completion: int, stats: SpecStats | None, cached: int | None) -> Usage:
    """The OpenAI usage of ``prompt`` and ``completion`` tokens, with the speculative statistics
    (``stats``; None: no step yet) and, for a session turn, the ``cached`` prompt tokens."""
    spec = SpecUsage()
    if stats is not None:
        spec = SpecUsage(
            num_verify_steps=stats.num_steps,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            mean_accepted_length=round(stats.mean_accepted_length, 4),
            accepted_per_position=list(stats.accepted_per_position),
        )
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached),
        speculative=spec,
    )


def _engine_message(exc: BaseException) -> str:
    """The engine's ValueError messages name ids and sizes, never text; cap their length."""
    message = str(exc) or type(exc).__name__
    return message[:300]
