"""Run the app in-process on the fake engine, with two tenants, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.main import create_app
from app.service import Service
from app.settings import Settings
from app.tenants import Tenant, TenantRegistry, hash_key
from tests.app.fake_engine import FakeEngine

KEY_A = "sk-test-alpha-0123456789"
KEY_B = "sk-test-beta-9876543210"
MODEL = "fake"


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def two_tenants(**beta_quotas: Any) -> TenantRegistry:
    return TenantRegistry(
        {
            "alpha": Tenant("alpha", hash_key(KEY_A)),
            "beta": Tenant("beta", hash_key(KEY_B), **beta_quotas),
        }
    )


@dataclass
class Harness:
    client: httpx.AsyncClient
    app: Any
    service: Service
    engine: FakeEngine

    async def complete(self, key: str = KEY_A, **body: Any) -> httpx.Response:
        body.setdefault("model", MODEL)
        return await self.client.post("/v1/completions", json=body, headers=auth(key))


@asynccontextmanager
async def running_app(
    engine: FakeEngine | None = None,
    tenants: TenantRegistry | None = None,
    **settings: Any,
) -> AsyncIterator[Harness]:
    engine = engine or FakeEngine()
    settings.setdefault("drain_timeout_s", 2.0)
    cfg = Settings(model=Path("models/fake"), served_model_name=MODEL, **settings)
    app = create_app(cfg, tenants or two_tenants(), engine_factory=lambda: engine)
    async with app.router.lifespan_context(app):
        service: Service = app.state.service
        for _ in range(500):
            if service.loop.ready:
                break
            await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Harness(client, app, service, engine)


def sse_payloads(text: str) -> list[Any]:
    """Parse an SSE body strictly: only ``data: ...`` events separated by blank lines."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == ""
    out: list[Any] = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out.count("[DONE]") == 1 and out[-1] == "[DONE]"
    return out[:-1]


def assert_error(resp: httpx.Response, status: int, param: str | None = "*") -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "*":
        assert err["param"] == param, err
    return err  # type: ignore[no-any-return]
