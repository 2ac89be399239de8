"""Turn started :class:`Choices` into an OpenAI completion or chat completion response."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from app.choices import Choices
from app.errors import APIError
from app.generation import Generation
from app.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from app.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from app.streaming import event_stream
from engine.logprobs import TokenLogprob
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


def _whole(
    gen: Generation, shape: Callable[[list[TokenLogprob]], dict[str, Any]]
) -> dict[str, Any] | None:
    """A whole choice's log-probabilities in ``shape`` (None where not asked for)."""
    return None if gen.inp.sampling.logprobs is None else shape([*gen.prompt_logprobs, *gen.logprobs])


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
    token_text = TokenTexts(choices.tokenizer)
    offsets = [0] * len(choices.gens)  # per choice: its text streamed so far

    def chunk(
        index: int, text: str | None, finish: str | None, lps: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        shaped = None if lps is None else completion_logprobs(token_text, lps, offsets[index])
        if shaped is not None and shaped["tokens"]:
            offsets[index] = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
        choice = {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": finish}
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
                logprobs=_whole(gen, lambda lps: completion_logprobs(token_text, lps)),
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
    token_text = TokenTexts(choices.tokenizer)

    def chunk(
        index: int, text: str | None, finish: str | None, lps: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        shaped = None if lps is None else chat_logprobs(token_text, lps)
        choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish}
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(usage: Usage) -> dict[str, Any]:
        return {**base, "choices": [], "usage": usage.model_dump(exclude_none=True)}

    if stream:
        first = []
        for index in range(len(choices.gens)):
            role = chunk(index, "", None, None)
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
                logprobs=_whole(gen, lambda lps: chat_logprobs(token_text, lps)),
                finish_reason=gen.finish_reason,
                token_ids=_token_ids(gen, return_token_ids),
            )
            for index, (gen, text) in enumerate(zip(choices.gens, texts, strict=True))
        ],
        usage=choices.usage(),
    )
    return JSONResponse(body.model_dump(exclude_none=True), headers=_headers(choices))
