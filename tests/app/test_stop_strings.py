"""Incremental detokenisation and stop strings under every chunking of the token stream."""

from __future__ import annotations

import random

import pytest

from app.stop_strings import IncrementalDetokenizer, StopMatcher
from tests.app.fake_engine import FakeTokenizer

TEXT = "Grüße, wörld! 🦊 fox jumps over the lazy dog. END here."


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


def _run(stops: list[str], seed: int) -> tuple[str, bool]:
    tok = FakeTokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1])
    matcher = StopMatcher(stops)
    pieces = []
    for chunk in _chunks(ids, random.Random(seed)):
        text = matcher.push(detok.push(chunk))
        assert "\ufffd" not in text
        pieces.append(text)
        if matcher.stopped:
            break
    else:
        pieces.append(matcher.push(detok.flush()))
        pieces.append(matcher.flush())
    return "".join(pieces), matcher.stopped


@pytest.mark.parametrize("seed", range(20))
def test_detokenizer_reassembles_text(seed: int) -> None:
    assert _run([], seed) == (TEXT, False)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("stop", ["fox", "ö", "🦊 f", "dog. END", "Grüße", "here."])
def test_stop_string_cut_at_first_occurrence(seed: int, stop: str) -> None:
    text, stopped = _run([stop, "never-there"], seed)
    assert stopped and text == TEXT[: TEXT.index(stop)]


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(["lazy", "jumps"])
    out = matcher.push("fox ju") + matcher.push("mps over the lazy")
    assert matcher.stopped and out == "fox "


def test_no_stop_releases_everything_at_flush() -> None:
    matcher = StopMatcher(["abcdef"])
    assert matcher.push("xxabc") == ""
    assert matcher.flush() == "xxabc"
