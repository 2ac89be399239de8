"""Prompt text -> token ids: plain prompts, token-id prompts and chat templates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.errors import APIError, bad_request
from app.schemas import ChatMessage


def echo_text(tokenizer: Any, prompt: str | list[int]) -> str:
    """The text ``echo`` sends before the completion: the prompt as given, or its token ids
    decoded (special tokens left out; "" where they do not decode: the engine rejects
    unknown ids)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return (
            str(tokenizer.decode(prompt, skip_special_tokens=True)) if tokenizer is not None else ""
        )
    except Exception:
        return ""


def encode_prompt(
    tokenizer: Any,
    prompt: str | list[int],
    *,
    add_special_tokens: bool = True,
    param: str = "prompt",
) -> list[int]:
    """Token ids of a prompt; a list of ints is taken as ids already."""
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids", param)
    try:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    except Exception:  # lone surrogates and the like: the client's input
        raise bad_request("the prompt could not be tokenized", param) from None
    ids = [int(t) for t in ids]
    if not ids:
        raise bad_request("the prompt is empty after tokenization", param)
    return ids


def _fallback_template(messages: Sequence[ChatMessage]) -> str:
    """For tokenizers without a chat template (test models): ``role: text`` lines."""
    lines = [f"{m.role}: {m.text()}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True
            )
        except Exception:  # template errors (e.g. roles out of order) are the client's input
            raise bad_request("the chat template rejected these messages", "messages") from None
        if not isinstance(text, str):
            raise APIError(400, "the chat template did not produce text", param="messages")
        # The template writes BOS itself.
        return encode_prompt(tokenizer, text, add_special_tokens=False, param="messages")
    return encode_prompt(tokenizer, _fallback_template(messages), param="messages")
