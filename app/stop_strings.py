"""Incremental detokenisation and stop strings that may straddle chunk boundaries.

Speculative decoding emits several tokens per step, and a multi-byte character or a stop string
can be split across steps. :class:`IncrementalDetokenizer` turns token ids into text deltas
(holding back a trailing incomplete character), and :class:`StopMatcher` holds back the last
``len(longest stop) - 1`` characters until it knows they do not start a stop string. The
streamed deltas and the non-streamed text come from the same code, so they are equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as decoding context: some tokenizers drop a leading space when decoding a
# sequence that starts mid-text.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self._ids)  # ids before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is left at the end, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_INCOMPLETE) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Cuts the text before the first stop string; the stop string itself is not returned."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; return what can be released now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        self._buffer += text
        hits = [i for i in (self._buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            released, self._buffer = self._buffer[: min(hits)], ""
            self.stopped = True
            return released
        keep = min(self._hold, len(self._buffer))
        released = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(released) :]
        return released

    def flush(self) -> str:
        """The held-back tail, at the end of generation."""
        released, self._buffer = ("" if self.stopped else self._buffer), ""
        return released
