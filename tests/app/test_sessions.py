"""Sessions: multi-turn reuse, isolation between tenants, closing zeroes KV."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.app.fake_engine import BOS, OFFSET, FakeEngine, expected_text
from tests.app.harness import (
    KEY_A,
    KEY_B,
    assert_error,
    auth,
    running_app,
    sse_payloads,
    two_tenants,
)

pytestmark = pytest.mark.anyio


def ids(text: str) -> list[int]:
    return [OFFSET + b for b in text.encode()]


async def test_second_turn_prefills_only_new_text_and_matches_one_request() -> None:
    async with running_app() as h:
        created = (await h.client.post("/v1/sessions", headers=auth())).json()
        assert set(created) == {"id", "expires_at"} and len(created["id"]) >= 32
        url = f"/v1/sessions/{created['id']}/completions"
        t1 = await h.client.post(url, json={"prompt": "Hello", "max_tokens": 7}, headers=auth())
        assert t1.status_code == 200, t1.text
        out1 = t1.json()["choices"][0]["text"]
        t2 = await h.client.post(url, json={"prompt": " more", "max_tokens": 9}, headers=auth())
        body2 = t2.json()
        assert body2["usage"]["prompt_tokens"] == len(ids(" more"))
        assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] == 1 + 5 + 7
        assert h.engine.prefilled_tokens[-1] == len(ids(" more"))  # only the new text
        whole = [BOS] + ids("Hello") + ids(out1) + ids(" more")
        single = await h.complete(prompt=whole, max_tokens=9, temperature=0)
        assert single.json()["choices"][0]["text"] == body2["choices"][0]["text"]
        info = (await h.client.get(f"/v1/sessions/{created['id']}", headers=auth())).json()
        assert info["num_tokens"] == len(whole) + 9 and info["busy"] is False


async def test_other_tenant_gets_404_everywhere(caplog: pytest.LogCaptureFixture) -> None:
    async with running_app() as h:
        sid = (await h.client.post("/v1/sessions", headers=auth(KEY_A))).json()["id"]
        other = auth(KEY_B)
        for resp in (
            await h.client.get(f"/v1/sessions/{sid}", headers=other),
            await h.client.delete(f"/v1/sessions/{sid}", headers=other),
            await h.client.post(
                f"/v1/sessions/{sid}/completions", json={"prompt": "x"}, headers=other
            ),
        ):
            assert assert_error(resp, 404)["code"] == "session_not_found"
        # Still alive for its owner; closing zeroes its blocks and writes an audit line.
        await h.client.post(
            f"/v1/sessions/{sid}/completions", json={"prompt": "abc", "max_tokens": 5},
            headers=auth(KEY_A),
        )  # fmt: skip
        with caplog.at_level(logging.INFO, logger="mtpserve.audit"):
            closed = (await h.client.delete(f"/v1/sessions/{sid}", headers=auth(KEY_A))).json()
        assert closed["id"] == sid and closed["closed"] is True and closed["zeroed_bytes"] > 0
        audits = [r for r in caplog.records if r.name == "mtpserve.audit"]
        assert audits and audits[-1].fields["session"] == sid  # type: ignore[attr-defined]
        assert audits[-1].fields["bytes_zeroed"] == closed["zeroed_bytes"]  # type: ignore[attr-defined]
        assert_error(await h.client.get(f"/v1/sessions/{sid}", headers=auth(KEY_A)), 404)
        assert_error(await h.client.get("/v1/sessions/not-a-session", headers=auth(KEY_A)), 404)


async def test_idle_sessions_expire_and_are_zeroed() -> None:
    async with running_app(session_idle_timeout_s=0.2, session_reap_interval_s=0.05) as h:
        sid = (await h.client.post("/v1/sessions", headers=auth())).json()["id"]
        await h.client.post(
            f"/v1/sessions/{sid}/completions", json={"prompt": "abc"}, headers=auth()
        )
        used = h.engine.kv_blocks_used
        assert used > 0
        await asyncio.sleep(0.5)
        assert_error(await h.client.get(f"/v1/sessions/{sid}", headers=auth()), 404)
        assert h.engine.kv_blocks_used == 0
        assert sid not in h.engine._sessions


async def test_session_quota_and_busy_session() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    async with running_app(engine, two_tenants(max_sessions=1)) as h:
        sid = (await h.client.post("/v1/sessions", headers=auth(KEY_B))).json()["id"]
        assert_error(await h.client.post("/v1/sessions", headers=auth(KEY_B)), 429)
        url = f"/v1/sessions/{sid}/completions"
        turn = asyncio.create_task(
            h.client.post(url, json={"prompt": "x", "max_tokens": 20}, headers=auth(KEY_B))
        )
        await asyncio.sleep(0.1)
        busy = await h.client.post(url, json={"prompt": "y"}, headers=auth(KEY_B))
        assert assert_error(busy, 409)["code"] == "session_busy"
        assert_error(await h.client.delete(f"/v1/sessions/{sid}", headers=auth(KEY_B)), 409)
        assert (await turn).status_code == 200
        assert (
            await h.client.delete(f"/v1/sessions/{sid}", headers=auth(KEY_B))
        ).status_code == 200
        assert (await h.client.post("/v1/sessions", headers=auth(KEY_B))).status_code == 200


async def test_session_stream_and_context_limit() -> None:
    async with running_app() as h:
        sid = (await h.client.post("/v1/sessions", headers=auth())).json()["id"]
        url = f"/v1/sessions/{sid}/completions"
        resp = await h.client.post(
            url, json={"prompt": "abc", "max_tokens": 6, "stream": True}, headers=auth()
        )
        text = "".join(c["choices"][0]["text"] for c in sse_payloads(resp.text))
        assert text == expected_text(4, 6)
        too_long = await h.client.post(url, json={"prompt": "x", "max_tokens": 600}, headers=auth())
        assert_error(too_long, 400, "max_tokens")


async def test_shutdown_closes_sessions() -> None:
    async with running_app() as h:
        engine = h.engine
        sid = (await h.client.post("/v1/sessions", headers=auth())).json()["id"]
        await h.client.post(f"/v1/sessions/{sid}/completions", json={"prompt": "a"}, headers=auth())
        assert engine.kv_blocks_used > 0
    assert engine.kv_blocks_used == 0 and not engine._sessions
