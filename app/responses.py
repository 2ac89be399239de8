"""Turn started :class:`Choices` into an OpenAI completion or chat completion response."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from app.choices import Choices
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


async def _collect(choices: Choices, request: Request) -> list[str]:
    try:
        return await choices.collect(request)
    except RequestFailed:
        choices.close(error=True)
        raise APIError(500, "the engine failed while generating", code="engine_error") from None
    finally:
        choices.close()


def _headers(choices: Choices) -> dict[str, str]:
    return {"X-Request-Id": choices.request_id}


def _token_ids(gen: Generation, wanted: bool) -> list[int] | None:
    return list(gen.token_ids) if wanted else None


async def completion_response(
    choices: Choices,
    request: Request,
    *,
    stream: bool,
    include_usage: bool,
    model: str,
    return_token_ids: bool = False,
) -> Response:
    base = {"id": choices.request_id, "object": "text_completion", "created": choices.created}
    base["model"] = model

    def chunk(index: int, text: str | None, finish: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(usage: Usage) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage.model_dump(exclude_none=True)}

    if stream:
        return event_stream(choices, chunk, usage_chunk if include_usage else None)
    texts = await _collect(choices, request)
    body = CompletionResponse(
        id=choices.request_id,
        created=choices.created,
        model=model,
        choices=[
            CompletionChoice(
                index=index,
                text=text,
                finish_reason=gen.finish_reason,
                token_ids=_token_ids(gen, return_token_ids),
            )
            for index, (gen, text) in enumerate(zip(choices.gens, texts, strict=True))
        ],
        usage=choices.usage(),
    )
    return JSONResponse(body.model_dump(exclude_none=True), headers=_headers(choices))


async def chat_response(
    choices: Choices,
    request: Request,
    *,
    stream: bool,
    include_usage: bool,
    model: str,
    return_token_ids: bool = False,
) -> Response:
    base = {"id": choices.request_id, "object": "chat.completion.chunk", "created": choices.created}
    base["model"] = model

    def chunk(index: int, text: str | None, finish: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(usage: Usage) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage.model_dump(exclude_none=True)}

    if stream:
        first = []
        for index in range(len(choices.gens)):
            role = chunk(index, "", None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            first.append(role)
        return event_stream(choices, chunk, usage_chunk if include_usage else None, first)
    texts = await _collect(choices, request)
    body = ChatCompletionResponse(
        id=choices.request_id,
        created=choices.created,
        model=model,
        choices=[
            ChatChoice(
                index=index,
                message=AssistantMessage(content=text),
                finish_reason=gen.finish_reason,
                token_ids=_token_ids(gen, return_token_ids),
            )
            for index, (gen, text) in enumerate(zip(choices.gens, texts, strict=True))
        ],
        usage=choices.usage(),
    )
    return JSONResponse(body.model_dump(exclude_none=True), headers=_headers(choices))
