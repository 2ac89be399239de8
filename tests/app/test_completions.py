"""Completions and chat over the ASGI transport with the fake engine."""

from __future__ import annotations

import pytest

from tests.app.fake_engine import expected_text
from tests.app.harness import assert_error, auth, running_app, sse_payloads

pytestmark = pytest.mark.anyio


async def test_completion_text_usage_and_speculative_extension() -> None:
    async with running_app() as h:
        resp = await h.complete(prompt="Hi", max_tokens=20, temperature=0)
        assert resp.status_code == 200
        body = resp.json()
        assert body["object"] == "text_completion" and body["model"] == "fake"
        choice = body["choices"][0]
        assert choice["text"] == expected_text(3, 20)  # BOS + "Hi" = 3 prompt tokens
        assert choice["finish_reason"] == "length"
        usage = body["usage"]
        assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 20
        assert usage["total_tokens"] == 23
        spec = usage["speculative"]
        assert spec["num_verify_steps"] > 0
        assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"][:1]) + sum(
            spec["accepted_per_position"][1:]
        )
        assert spec["mean_accepted_length"] == pytest.approx(
            1 + spec["num_accepted_tokens"] / spec["num_verify_steps"], abs=1e-3
        )


async def test_stream_equals_non_stream_and_sse_format() -> None:
    async with running_app() as h:
        plain = (await h.complete(prompt="Hey", max_tokens=40)).json()["choices"][0]["text"]
        resp = await h.complete(
            prompt="Hey", max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(resp.text)
        *text_chunks, usage_chunk = chunks
        assert "".join(c["choices"][0]["text"] for c in text_chunks) == plain
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["usage"] is None for c in text_chunks)
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 40
        assert "speculative" in usage_chunk["usage"]
        # Multi-byte characters arrive whole even though tokens are single bytes.
        assert not any("\ufffd" in c["choices"][0]["text"] for c in text_chunks)


async def test_chat_stream_and_non_stream() -> None:
    async with running_app() as h:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hello"}]}
        plain = await h.client.post(
            "/v1/chat/completions", json={**body, "max_completion_tokens": 12}, headers=auth()
        )
        assert plain.status_code == 200
        message = plain.json()["choices"][0]["message"]
        assert message["role"] == "assistant"
        resp = await h.client.post(
            "/v1/chat/completions", json={**body, "max_tokens": 12, "stream": True}, headers=auth()
        )
        chunks = sse_payloads(resp.text)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == message["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stop", ["fox", "k brown", "ö", "wörld!"])
async def test_stop_strings_across_steps(stop: str) -> None:
    async with running_app() as h:
        full = expected_text(1, 60)
        cut = full[: full.index(stop)]
        plain = await h.complete(prompt=[1], max_tokens=60, stop=[stop, "zzz"])
        assert plain.json()["choices"][0] == {
            "index": 0,
            "text": cut,
            "finish_reason": "stop",
        }
        streamed = await h.complete(prompt=[1], max_tokens=60, stop=stop, stream=True)
        chunks = sse_payloads(streamed.text)
        assert "".join(c["choices"][0]["text"] for c in chunks) == cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_token_id_prompt_and_batch_of_one() -> None:
    async with running_app() as h:
        a = await h.complete(prompt=[1, 75, 108], max_tokens=5)
        b = await h.complete(prompt=[[1, 75, 108]], max_tokens=5)
        c = await h.complete(prompt=["Hi"], max_tokens=5)  # "Hi" -> [1, 75, 108]
        texts = {r.json()["choices"][0]["text"] for r in (a, b, c)}
        assert texts == {expected_text(3, 5)}


async def test_models_list_and_unknown_model() -> None:
    async with running_app() as h:
        resp = await h.client.get("/v1/models", headers=auth())
        assert resp.json()["data"][0]["id"] == "fake"
        assert (await h.client.get("/v1/models/fake", headers=auth())).status_code == 200
        assert_error(await h.client.get("/v1/models/nope", headers=auth()), 404)
        err = assert_error(await h.complete(prompt="x", model="other"), 404, "model")
        assert err["code"] == "model_not_found"


async def test_engine_failure_mid_stream_sends_error_chunk_then_done() -> None:
    async with running_app() as h:
        h.engine.step_delay_s = 0.01
        h.engine.fail_next_step = True
        resp = await h.complete(prompt="x", max_tokens=8, stream=True)
        events = sse_payloads(resp.text)
        assert "error" in events[-1] and set(events[-1]["error"]) == {
            "message", "type", "param", "code",
        }  # fmt: skip
        # The engine keeps serving afterwards.
        assert (await h.complete(prompt="x", max_tokens=4)).status_code == 200


async def test_an_engine_that_does_not_recover_stops_taking_requests() -> None:
    async with running_app() as h:
        h.engine.step_delay_s = 0.01
        h.engine.break_next_step = True
        assert_error(await h.complete(prompt="x", max_tokens=8), 500)
        ready = await h.client.get("/ready")
        assert assert_error(ready, 503)["code"] == "engine_failed"
        assert assert_error(await h.complete(prompt="x", max_tokens=4), 503)["code"] == "engine_failed"


@pytest.mark.parametrize("empty_failures", [1, 2])
async def test_steps_failing_with_no_request_in_them_give_the_engine_up_on_the_second(
    empty_failures: int,
) -> None:
    async with running_app() as h:
        h.engine.step_delay_s = 0.01
        h.engine.fail_empty_steps = empty_failures
        resp = await h.complete(prompt="x", max_tokens=8)
        if empty_failures == 1:  # one, attributed to nothing: the request still runs
            assert resp.status_code == 200
            assert (await h.client.get("/ready")).status_code == 200
        else:
            assert_error(resp, 500)
            assert assert_error(await h.client.get("/ready"), 503)["code"] == "engine_failed"


async def test_eos_finishes_with_stop() -> None:
    async with running_app() as h:
        h.engine.eos_after = 3
        body = (await h.complete(prompt="x", max_tokens=10)).json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 4  # three tokens and EOS
        assert body["choices"][0]["text"] == expected_text(2, 3)
