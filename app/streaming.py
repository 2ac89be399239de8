"""Server-sent events in the OpenAI format: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]``.

An engine failure after the response started is sent as an error chunk, then ``[DONE]``. If the
client goes away, Starlette cancels the generator and ``Generation.close()`` (in ``finally``)
aborts the request, which frees and zeroes its KV before the next engine step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import error_body
from app.generation import Generation
from app.schemas import Usage
from engine.serving import RequestFailed

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

ChunkFn = Callable[[str | None, str | None], dict[str, Any]]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(
    gen: Generation,
    chunk: ChunkFn,
    usage_chunk: Callable[[Usage], dict[str, Any]] | None,
    first: dict[str, Any] | None,
) -> AsyncIterator[str]:
    failed = False
    try:
        if first is not None:
            yield sse(first)
        async for text in gen.deltas():
            yield sse(chunk(text, None))
        yield sse(chunk(None, gen.finish_reason))
        if usage_chunk is not None:
            yield sse(usage_chunk(gen.usage()))
        yield DONE
    except RequestFailed:
        failed = True
        yield sse(error_body(500, "the engine failed while generating", code="engine_error"))
        yield DONE
    finally:
        gen.close(error=failed)


class GenerationStreamingResponse(StreamingResponse):
    """Closes the generation even when the body iterator never started (the client left
    before the first byte), so the request is aborted and its quota lease returned."""

    def __init__(self, gen: Generation, content: AsyncIterator[str]) -> None:
        headers = {**SSE_HEADERS, "X-Request-Id": gen.request_id}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._generation = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


def event_stream(
    gen: Generation,
    chunk: ChunkFn,
    usage_chunk: Callable[[Usage], dict[str, Any]] | None,
    first: dict[str, Any] | None = None,
) -> StreamingResponse:
    return GenerationStreamingResponse(gen, _events(gen, chunk, usage_chunk, first))
