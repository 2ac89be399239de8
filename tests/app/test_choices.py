"""Several choices per request: ``n`` per prompt and batches of prompts (``app/choices.py``),
streamed and not, their usage, all-or-nothing admission and cleanup."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from tests.app.fake_engine import FakeEngine, expected_text
from tests.app.harness import KEY_B, assert_error, auth, running_app, sse_payloads, two_tenants
from tests.app.test_disconnect import _call_then_disconnect, wait_until

pytestmark = pytest.mark.anyio


def _check_spec_usage(usage: dict[str, Any]) -> None:
    spec = usage["speculative"]
    assert spec["num_verify_steps"] > 0
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_verify_steps"], abs=1e-3
    )


async def test_a_batch_of_prompts_with_n_choices_each() -> None:
    """Choice i of prompt p has index p * n + i; each prompt's tokens count once in the usage,
    every choice's completion tokens and speculative steps are summed."""
    async with running_app() as h:
        resp = await h.complete(prompt=["Hi", "Hello"], n=2, max_tokens=10, temperature=0)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        texts = [c["text"] for c in body["choices"]]
        assert texts == [expected_text(3, 10)] * 2 + [expected_text(6, 10)] * 2  # BOS + bytes
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        usage = body["usage"]
        assert usage["prompt_tokens"] == 3 + 6 and usage["completion_tokens"] == 40
        assert usage["total_tokens"] == 49
        _check_spec_usage(usage)
        single = (await h.complete(prompt="Hi", max_tokens=10, temperature=0)).json()
        assert len(body["usage"]["speculative"]["accepted_per_position"]) >= len(
            single["usage"]["speculative"]["accepted_per_position"]
        )
        ids = await h.complete(prompt=[[1, 3 + ord("H")], [1]], max_tokens=5, return_token_ids=True)
        choices = ids.json()["choices"]
        assert [c["text"] for c in choices] == [expected_text(2, 5), expected_text(1, 5)]
        assert all(len(c["token_ids"]) == 5 for c in choices)


async def test_streamed_choices_interleave_and_each_ends_once() -> None:
    async with running_app(FakeEngine(step_delay_s=0.005)) as h:
        body = {"prompt": ["Hey", "Yo"], "n": 2, "max_tokens": 30, "temperature": 0}
        plain = (await h.complete(**body)).json()
        resp = await h.complete(**body, stream=True, stream_options={"include_usage": True})
        assert resp.status_code == 200
        *chunks, usage_chunk = sse_payloads(resp.text)
        texts: dict[int, str] = defaultdict(str)
        finishes: dict[int, list[int]] = defaultdict(list)
        for position, chunk in enumerate(chunks):
            (choice,) = chunk["choices"]
            assert chunk["id"] == chunks[0]["id"] and chunk["usage"] is None
            assert not finishes[choice["index"]], "a piece after its choice's finish"
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"] is not None:
                finishes[choice["index"]].append(position)
        assert [texts[i] for i in range(4)] == [c["text"] for c in plain["choices"]]
        assert all(len(finishes[i]) == 1 for i in range(4))
        indices = [c["choices"][0]["index"] for c in chunks]
        assert indices != sorted(indices), "the choices stream as they come, not one after another"
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 120
        assert usage_chunk["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == 4 + 3


async def test_chat_with_n_choices() -> None:
    async with running_app() as h:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "n": 3,
                "max_tokens": 8}  # fmt: skip
        plain = await h.client.post("/v1/chat/completions", json=body, headers=auth())
        choices = plain.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert len({c["message"]["content"] for c in choices}) == 1  # the fake engine is deterministic
        resp = await h.client.post("/v1/chat/completions", json={**body, "stream": True}, headers=auth())
        chunks = sse_payloads(resp.text)
        assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""}] * 3
        assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
        content: dict[int, str] = defaultdict(str)
        for chunk in chunks[3:]:
            content[chunk["choices"][0]["index"]] += chunk["choices"][0]["delta"].get("content", "")
        assert [content[i] for i in range(3)] == [c["message"]["content"] for c in choices]


async def test_admission_is_all_or_nothing() -> None:
    """A choice refused by the tenant's quota refuses the request and releases the choices
    already queued: nothing keeps running, every lease is returned."""
    engine = FakeEngine(step_delay_s=0.01)
    async with running_app(engine, two_tenants(max_concurrent_requests=2)) as h:
        assert_error(await h.complete(KEY_B, prompt="x", n=3, max_tokens=50), 429)
        await wait_until(lambda: h.service.loop.num_active == 0)
        assert not engine._requests and engine.kv_blocks_used == 0
        assert h.service.quotas.concurrent("beta") == 0
        resp = await h.complete(KEY_B, prompt="x", n=2, max_tokens=5)
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
        # A prompt of a batch that does not fit the context refuses the whole batch.
        too_long = "x" * 600
        assert_error(await h.complete(prompt=["ok", too_long], max_tokens=4), 400, "prompt")


async def test_disconnect_aborts_every_choice() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    async with running_app(engine) as h:
        body = {"model": "fake", "prompt": ["x", "y"], "n": 2, "max_tokens": 400, "stream": True}
        sent = await _call_then_disconnect(h.app, body, after_chunks=5)
        assert sent[0]["status"] == 200
        await wait_until(lambda: not engine._requests and engine.kv_blocks_used == 0)
        await wait_until(lambda: h.service.loop.num_active == 0)
        assert h.service.quotas.concurrent("alpha") == 0
        body = {"model": "fake", "prompt": "x", "n": 3, "max_tokens": 400}
        await _call_then_disconnect(h.app, body, after_chunks=0)
        await wait_until(lambda: not engine._requests and engine.kv_blocks_used == 0)


async def test_a_session_turn_has_one_prompt_and_one_choice() -> None:
    async with running_app() as h:
        created = await h.client.post("/v1/sessions", json={}, headers=auth())
        url = f"/v1/sessions/{created.json()['id']}/completions"
        assert_error(await h.client.post(url, json={"prompt": "x", "n": 2}, headers=auth()), 400, "n")
        batch = {"prompt": ["x", "y"]}
        assert_error(await h.client.post(url, json=batch, headers=auth()), 400, "prompt")
        resp = await h.client.post(url, json={"prompt": ["x"], "max_tokens": 3}, headers=auth())
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 1
