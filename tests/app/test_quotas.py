"""Per-tenant quotas and the bounded waiting queue answer 429 with Retry-After."""

from __future__ import annotations

import asyncio

import pytest

from app.quotas import QuotaExceeded, QuotaManager
from app.tenants import Tenant
from tests.app.fake_engine import FakeEngine
from tests.app.harness import KEY_A, KEY_B, assert_error, running_app, two_tenants

pytestmark = pytest.mark.anyio


async def test_concurrency_quota_is_per_tenant() -> None:
    tenants = two_tenants(max_concurrent_requests=1)
    async with running_app(FakeEngine(step_delay_s=0.02), tenants) as h:
        slow = asyncio.create_task(h.complete(KEY_B, prompt="x", max_tokens=30))
        await asyncio.sleep(0.1)
        resp = await h.complete(KEY_B, prompt="y", max_tokens=2)
        err = assert_error(resp, 429)
        assert err["type"] == "rate_limit_error" and int(resp.headers["Retry-After"]) >= 1
        # The other tenant is not affected.
        assert (await h.complete(KEY_A, prompt="z", max_tokens=2)).status_code == 200
        assert (await slow).status_code == 200
        assert (await h.complete(KEY_B, prompt="y", max_tokens=2)).status_code == 200


async def test_requests_per_minute() -> None:
    async with running_app(tenants=two_tenants(requests_per_minute=2)) as h:
        for _ in range(2):
            assert (await h.complete(KEY_B, prompt="x", max_tokens=1)).status_code == 200
        resp = await h.complete(KEY_B, prompt="x", max_tokens=1)
        assert_error(resp, 429)
        assert 1 <= int(resp.headers["Retry-After"]) <= 60


async def test_kv_token_quota() -> None:
    async with running_app(tenants=two_tenants(max_kv_tokens=50)) as h:
        assert (await h.complete(KEY_B, prompt="x", max_tokens=20)).status_code == 200
        assert_error(await h.complete(KEY_B, prompt="x", max_tokens=60), 429)


async def test_queue_full_is_429() -> None:
    engine = FakeEngine(step_delay_s=0.03)
    async with running_app(engine, max_batch=1, max_waiting=1) as h:
        first = asyncio.create_task(h.complete(prompt="x", max_tokens=60))
        for _ in range(500):  # let the first request reach the engine before the others arrive
            if engine.num_running == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == 1
        rest = [asyncio.create_task(h.complete(prompt="x", max_tokens=15)) for _ in range(3)]
        results = [await first] + [await t for t in rest]
        statuses = sorted(r.status_code for r in results)
        assert statuses == [200, 200, 429, 429]  # one running, one queued, the rest refused
        full = [r for r in results if r.status_code == 429]
        assert all(assert_error(r, 429)["code"] == "queue_full" for r in full)
        assert all(r.headers["Retry-After"] == "1" for r in full)


def test_tokens_per_minute_window_slides() -> None:
    now = [1000.0]
    quotas = QuotaManager(clock=lambda: now[0])
    tenant = Tenant("t", "0" * 64, tokens_per_minute=100)
    lease = quotas.acquire(tenant, prompt_tokens=40, kv_tokens=50)
    quotas.release(lease)
    quotas.add_tokens("t", 50)
    with pytest.raises(QuotaExceeded) as info:
        quotas.acquire(tenant, prompt_tokens=20, kv_tokens=30)
    assert 0 < info.value.retry_after <= 60
    now[0] += 61
    quotas.release(quotas.acquire(tenant, prompt_tokens=20, kv_tokens=30))
    with pytest.raises(QuotaExceeded):
        quotas.acquire(tenant, prompt_tokens=101, kv_tokens=101)


async def test_drain_finishes_in_flight_and_refuses_new() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    async with running_app(engine, drain_timeout_s=10) as h:
        running = asyncio.create_task(h.complete(prompt="x", max_tokens=60))
        await asyncio.sleep(0.1)
        drain = asyncio.create_task(h.service.drain())
        await asyncio.sleep(0.05)
        assert_error(await h.complete(prompt="y", max_tokens=2), 503)
        resp = await running
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 60
        await drain
