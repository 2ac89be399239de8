"""Generated tokens' log-probabilities in OpenAI's two shapes (``engine.logprobs``: the model's
raw distribution, each token with its position's most likely alternatives).

A token's text is its own decoding (``tokenizer.decode([id])``, special tokens as ""), and its
``bytes`` that text's UTF-8, as vLLM gives them: a token holding part of a multi-byte character
shows as U+FFFD. With ``echo`` the prompt's tokens come first, the first of them with no
log-probability (null).
"""

from __future__ import annotations

import math
from typing import Any

from engine.logprobs import TokenLogprob


class TokenTexts:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=True
            )
        return text


def completion_logprobs(
    texts: TokenTexts, logprobs: list[TokenLogprob], text_offset: int = 0
) -> dict[str, Any]:
    """The completions shape: parallel lists of tokens, their log-probabilities, their top
    alternatives (text -> log-probability) and where each token's text starts in the choice's
    text (counted from ``text_offset``)."""
    tokens = [texts(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    known = [not math.isnan(lp.logprob) for lp in logprobs]  # an echoed prompt's first: no context
    return {
        "tokens": tokens,
        "token_logprobs": [
            lp.logprob if ok else None for lp, ok in zip(logprobs, known, strict=True)
        ],
        "top_logprobs": [
            {texts(t): v for t, v in lp.top} if ok else None
            for lp, ok in zip(logprobs, known, strict=True)
        ],
        "text_offset": offsets,
    }


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: one entry per token with its bytes and its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }
