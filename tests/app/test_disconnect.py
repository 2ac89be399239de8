"""A client that disconnects mid-stream has its request aborted and its KV freed and zeroed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.harness import KEY_A, running_app

pytestmark = pytest.mark.anyio


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def _scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {KEY_A}".encode()),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }


async def _call_then_disconnect(app: Any, body: dict[str, Any], after_chunks: int) -> list[Any]:
    raw = json.dumps(body).encode()
    chunks_seen = asyncio.Event()
    sent: list[Any] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await chunks_seen.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        data = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if len(data) >= after_chunks:
            chunks_seen.set()

    await asyncio.wait_for(app(_scope("/v1/completions", raw), receive, send), 10)
    return sent


def _sample(h: Any, name: str, **labels: str) -> float:
    value = h.service.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


async def test_disconnect_mid_stream_frees_and_zeroes_kv() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    async with running_app(engine) as h:
        zeroed_before = _sample(h, "mtpserve_kv_zeroed_bytes_total")
        body = {"model": "fake", "prompt": "x", "max_tokens": 400, "stream": True}
        sent = await _call_then_disconnect(h.app, body, after_chunks=3)
        assert sent[0]["status"] == 200
        await wait_until(lambda: not engine._requests and engine.kv_blocks_used == 0)
        await wait_until(lambda: _sample(h, "mtpserve_kv_zeroed_bytes_total") > zeroed_before)
        await wait_until(lambda: h.service.loop.num_active == 0)
        assert _sample(h, "mtpserve_requests_total", tenant="alpha", status="abort") == 1
        assert h.service.quotas.concurrent("alpha") == 0
        # The engine keeps serving.
        resp = await h.complete(prompt="y", max_tokens=4)
        assert resp.status_code == 200


async def test_disconnect_while_waiting_for_a_non_streamed_answer() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    async with running_app(engine) as h:
        body = {"model": "fake", "prompt": "x", "max_tokens": 400}
        task = asyncio.create_task(_call_then_disconnect(h.app, body, after_chunks=0))
        await task
        await wait_until(lambda: not engine._requests and engine.kv_blocks_used == 0)
        assert len(engine.prefilled_tokens) == 1


async def test_disconnect_before_the_first_streamed_byte_releases_everything() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    async with running_app(engine) as h:
        for _ in range(5):
            body = {"model": "fake", "prompt": "x", "max_tokens": 300, "stream": True}
            await _call_then_disconnect(h.app, body, after_chunks=0)
        await wait_until(lambda: not engine._requests and engine.kv_blocks_used == 0)
        await wait_until(lambda: h.service.quotas.concurrent("alpha") == 0)
        assert h.service.loop.num_active == 0
