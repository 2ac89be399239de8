"""Turn a started :class:`Generation` into an OpenAI completion or chat completion response."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from app.errors import APIError
from app.generation import Generation
from app.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from app.streaming import event_stream
from engine.serving import RequestFailed


async def _collect(gen: Generation, request: Request) -> str:
    try:
        return await gen.collect(request)
    except RequestFailed:
        gen.close(error=True)
        raise APIError(500, "the engine failed while generating", code="engine_error") from None
    finally:
        gen.close()


def _headers(gen: Generation) -> dict[str, str]:
    return {"X-Request-Id": gen.request_id}


async def completion_response(
    gen: Generation,
    request: Request,
    *,
    stream: bool,
    include_usage: bool,
    model: str,
    return_token_ids: bool = False,
) -> Response:
    base = {"id": gen.request_id, "object": "text_completion", "created": gen.created}
    base["model"] = model

    def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(usage: Usage) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage.model_dump(exclude_none=True)}

    if stream:
        return event_stream(gen, chunk, usage_chunk if include_usage else None)
    text = await _collect(gen, request)
    body = CompletionResponse(
        id=gen.request_id,
        created=gen.created,
        model=model,
        choices=[
            CompletionChoice(
                text=text,
                finish_reason=gen.finish_reason,
                token_ids=list(gen.token_ids) if return_token_ids else None,
            )
        ],
        usage=gen.usage(),
    )
    return JSONResponse(body.model_dump(exclude_none=True), headers=_headers(gen))


async def chat_response(
    gen: Generation,
    request: Request,
    *,
    stream: bool,
    include_usage: bool,
    model: str,
    return_token_ids: bool = False,
) -> Response:
    base = {"id": gen.request_id, "object": "chat.completion.chunk", "created": gen.created}
    base["model"] = model

    def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(usage: Usage) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage.model_dump(exclude_none=True)}

    if stream:
        first = chunk("", None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return event_stream(gen, chunk, usage_chunk if include_usage else None, first)
    text = await _collect(gen, request)
    body = ChatCompletionResponse(
        id=gen.request_id,
        created=gen.created,
        model=model,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=text),
                finish_reason=gen.finish_reason,
                token_ids=list(gen.token_ids) if return_token_ids else None,
            )
        ],
        usage=gen.usage(),
    )
    return JSONResponse(body.model_dump(exclude_none=True), headers=_headers(gen))
