"""Log-probabilities over HTTP (``app/logprobs.py``): OpenAI's completions and chat shapes,
streamed and not, on the fake engine (every token -0.25, its top k the token and the ids after
it)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.app.fake_engine import FakeEngine, FakeTokenizer
from tests.app.harness import assert_error, auth, running_app, sse_payloads

pytestmark = pytest.mark.anyio
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}


async def test_completion_logprobs_shape() -> None:
    async with running_app() as h:
        body = (await h.complete(prompt="Hi", max_tokens=9, logprobs=2, return_token_ids=True)).json()
        choice = body["choices"][0]
        lp = choice["logprobs"]
        ids = choice["token_ids"]
        decode = FakeTokenizer().decode
        assert lp["tokens"] == [decode([t]) for t in ids]
        # Each token is its own text: the two bytes of "ö" show as U+FFFD each (as vLLM's).
        assert "".join(lp["tokens"]).replace("\ufffd\ufffd", "ö") == choice["text"] == "lo, wörl"
        assert lp["token_logprobs"] == [-0.25] * 9
        assert lp["top_logprobs"] == [{decode([t]): -0.25, decode([t + 1]): -1.0} for t in ids]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(9)]
        plain = (await h.complete(prompt="Hi", max_tokens=9)).json()["choices"][0]
        assert plain.get("logprobs") is None
        zero = (await h.complete(prompt="Hi", max_tokens=3, logprobs=0)).json()["choices"][0]["logprobs"]
        assert zero["top_logprobs"] == [{}, {}, {}] and len(zero["token_logprobs"]) == 3


async def test_streamed_logprobs_add_up_to_the_whole() -> None:
    async with running_app(FakeEngine(step_delay_s=0.002)) as h:
        body = {"prompt": ["Hey", "Yo"], "n": 2, "max_tokens": 20, "logprobs": 1}
        whole = (await h.complete(**body)).json()["choices"]
        resp = await h.complete(**body, stream=True)
        tokens: dict[int, list[str]] = defaultdict(list)
        offsets: dict[int, list[int]] = defaultdict(list)
        for chunk in sse_payloads(resp.text):
            (choice,) = chunk["choices"]
            if choice["logprobs"] is not None:
                tokens[choice["index"]] += choice["logprobs"]["tokens"]
                offsets[choice["index"]] += choice["logprobs"]["text_offset"]
        for i, want in enumerate(whole):
            assert tokens[i] == want["logprobs"]["tokens"]
            assert offsets[i] == want["logprobs"]["text_offset"]


async def test_chat_logprobs_shape_and_stream() -> None:
    async with running_app() as h:
        body = {**CHAT, "logprobs": True, "top_logprobs": 2}
        choice = (await h.client.post("/v1/chat/completions", json=body, headers=auth())).json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert len(content) == 9
        for entry in content:
            assert entry["logprob"] == -0.25 and entry["bytes"] == list(entry["token"].encode())
            assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25, -1.0]
            assert entry["top_logprobs"][0]["token"] == entry["token"]
        resp = await h.client.post("/v1/chat/completions", json={**body, "stream": True}, headers=auth())
        streamed = [e for c in sse_payloads(resp.text) if c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
        assert streamed == content
        bare = {**CHAT, "logprobs": True}
        entries = (await h.client.post("/v1/chat/completions", json=bare, headers=auth())).json()
        assert all(e["top_logprobs"] == [] for e in entries["choices"][0]["logprobs"]["content"])


async def test_bad_logprobs_requests() -> None:
    async with running_app() as h:
        assert_error(await h.complete(prompt="x", logprobs=21), 400, "logprobs")
        assert_error(await h.complete(prompt="x", logprobs=-1), 400, "logprobs")
        url = "/v1/chat/completions"
        resp = await h.client.post(url, json={**CHAT, "top_logprobs": 2}, headers=auth())
        assert "top_logprobs needs logprobs" in assert_error(resp, 400)["message"]
        resp = await h.client.post(url, json={**CHAT, "logprobs": True, "top_logprobs": 21}, headers=auth())
        assert_error(resp, 400, "top_logprobs")


async def test_echo_sends_the_prompt_first_with_its_logprobs() -> None:
    async with running_app() as h:
        plain = (await h.complete(prompt="Hi", max_tokens=4)).json()["choices"][0]["text"]
        echoed = (await h.complete(prompt="Hi", max_tokens=4, echo=True)).json()["choices"][0]
        assert echoed["text"] == "Hi" + plain and echoed.get("logprobs") is None
        ids = [1, 3 + ord("H"), 3 + ord("i")]
        assert (await h.complete(prompt=ids, max_tokens=4, echo=True)).json()["choices"][0]["text"] == "Hi" + plain
        body = {"prompt": "Hi", "max_tokens": 4, "echo": True, "logprobs": 1}
        choice = (await h.complete(**body)).json()["choices"][0]
        lp = choice["logprobs"]
        assert lp["tokens"][:3] == ["", "H", "i"]  # BOS (special: no text), then the prompt's
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == [-0.25] * 6
        assert [choice["text"][o : o + len(t)] for t, o in zip(lp["tokens"], lp["text_offset"], strict=True)] == lp["tokens"]
        resp = await h.complete(**body, stream=True)
        chunks = [c["choices"][0] for c in sse_payloads(resp.text)]
        assert chunks[0]["text"].startswith("Hi")
        assert "".join(c["text"] for c in chunks) == choice["text"]
        streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert streamed == lp["tokens"]


def test_chat_bytes_are_a_byte_level_tokens_own() -> None:
    """With the demo model's byte-level BPE tokenizer, the pieces of a multi-byte character
    carry their own bytes, which join into the character (their texts show U+FFFD)."""
    from transformers import AutoTokenizer

    from app.logprobs import TokenTexts, chat_logprobs
    from engine.logprobs import TokenLogprob

    tokenizer = AutoTokenizer.from_pretrained("models/demo")
    ids = tokenizer.encode("wörld 🦊", add_special_tokens=True)
    content = chat_logprobs(TokenTexts(tokenizer), [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids])["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == "wörld 🦊"  # BOS: no bytes
    assert "\ufffd" in "".join(e["token"] for e in content)
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
