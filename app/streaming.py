"""Server-sent events in the OpenAI format: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]``.

The choices of a request (``app.choices``) stream interleaved, each chunk naming its choice's
index. An engine failure after the response started is sent as an error chunk, then
``[DONE]``. If the client goes away, Starlette cancels the generator and ``Choices.close()``
(in ``finally``) aborts the requests, which frees and zeroes their KV before the next engine
step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.choices import Choices
from app.errors import error_body
from app.schemas import Usage
from engine.logprobs import TokenLogprob
from engine.serving import RequestFailed

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# (index, text, finish, the log-probabilities since the choice's last chunk) -> a chunk
ChunkFn = Callable[[int, str | None, str | None, list[TokenLogprob] | None], dict[str, Any]]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(
    choices: Choices,
    chunk: ChunkFn,
    usage_chunk: Callable[[Usage], dict[str, Any]] | None,
    first: list[dict[str, Any]],
) -> AsyncIterator[str]:
    failed = False
    try:
        for payload in first:
            yield sse(payload)
        async for index, text, finish, logprobs in choices.events():
            yield sse(chunk(index, text, finish, logprobs))
        if usage_chunk is not None:
            yield sse(usage_chunk(choices.usage()))
        yield DONE
    except RequestFailed:
        failed = True
        yield sse(error_body(500, "the engine failed while generating", code="engine_error"))
        yield DONE
    finally:
        choices.close(error=failed)


class GenerationStreamingResponse(StreamingResponse):
    """Closes the choices even when the body iterator never started (the client left before
    the first byte), so their requests are aborted and their quota leases returned."""

    def __init__(self, choices: Choices, content: AsyncIterator[str]) -> None:
        headers = {**SSE_HEADERS, "X-Request-Id": choices.request_id}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.close()


def event_stream(
    choices: Choices,
    chunk: ChunkFn,
    usage_chunk: Callable[[Usage], dict[str, Any]] | None,
    first: list[dict[str, Any]] | None = None,
) -> StreamingResponse:
    return GenerationStreamingResponse(choices, _events(choices, chunk, usage_chunk, first or []))
