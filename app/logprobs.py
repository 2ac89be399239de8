"""Generated tokens' log-probabilities in OpenAI's two shapes (``engine.logprobs``: the model's
raw distribution, each token with its position's most likely alternatives).

A token's text is its own decoding (``tokenizer.decode([id])``, special tokens as ""): a token
holding part of a multi-byte character shows as U+FFFD, as in vLLM. Its ``bytes`` (chat) are
its exact bytes where the tokenizer is byte-level BPE (those pieces included), else its text's
UTF-8. With ``echo`` the prompt's tokens come first, the first of them with no
log-probability (null).
"""

from __future__ import annotations

import math
from typing import Any

from engine.logprobs import TokenLogprob


class TokenTexts:
    """Token id -> its text, decoded once per id, and its bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._byte_of = _byte_level_alphabet(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", ()))

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: for a byte-level BPE tokenizer its exact bytes (a piece of
        a multi-byte character included), else its text's UTF-8."""
        if self._byte_of is not None and token_id not in self._special:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in self._byte_of for ch in piece):
                return [self._byte_of[ch] for ch in piece]
        return list(self(token_id).encode("utf-8"))

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
        return {"token": texts(token_id), "logprob": logprob, "bytes": texts.token_bytes(token_id)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int] | None:
    """Character -> byte of a byte-level BPE tokenizer's token alphabet (GPT-2's, which
    DeepSeek-V3's tokenizer and the demo model's use); None for other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return None
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # moved in some transformers version: the text's UTF-8 then
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}
