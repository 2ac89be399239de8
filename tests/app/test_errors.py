"""Every error has the OpenAI shape, the right status, and names the field."""

from __future__ import annotations

import pytest

from tests.app.harness import KEY_A, assert_error, auth, running_app

pytestmark = pytest.mark.anyio


async def test_auth_errors() -> None:
    async with running_app() as h:
        resp = await h.client.post("/v1/completions", json={"prompt": "x"})
        assert assert_error(resp, 401)["code"] == "invalid_api_key"
        resp = await h.client.post(
            "/v1/completions", json={"prompt": "x"}, headers=auth(KEY_A + "x")
        )
        assert_error(resp, 401)
        resp = await h.client.get("/v1/models", headers={"Authorization": "Basic abc"})
        assert_error(resp, 401)
        # Liveness and readiness need no key.
        assert (await h.client.get("/health")).json() == {"status": "ok"}
        assert (await h.client.get("/ready")).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": ["x"] * 65, "n": 2}, "n"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "bogus_field": 1}, "bogus_field"),
        ({"prompt": "x", "stop": [""]}, "stop.0"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
        ({"prompt": "x" * 600}, "prompt"),
        ({"prompt": "x", "max_tokens": 600}, "max_tokens"),
        ({}, "prompt"),
    ],
)
async def test_completion_validation_names_field(body: dict, param: str | None) -> None:
    async with running_app(max_body_bytes=1 << 20) as h:
        resp = await h.client.post("/v1/completions", json=body, headers=auth())
        err = assert_error(resp, 400)
        if param is not None:
            assert err["param"] == param
            assert (
                err["message"].startswith(param.split(".")[0])
                or param in err["message"]
                or (err["code"] in ("invalid_request", "context_length_exceeded"))
            )
        assert "xxxxxxxx" not in err["message"]  # no prompt text in messages


async def test_chat_validation() -> None:
    async with running_app() as h:
        url = "/v1/chat/completions"
        resp = await h.client.post(url, json={"messages": []}, headers=auth())
        assert_error(resp, 400, "messages")
        bad_role = {"messages": [{"role": "wizard", "content": "x"}]}
        resp = await h.client.post(url, json=bad_role, headers=auth())
        assert_error(resp, 400, "messages.0.role")
        tools = {"messages": [{"role": "user", "content": "x"}], "tools": []}
        assert_error(await h.client.post(url, json=tools, headers=auth()), 400, "tools")


async def test_malformed_bodies_are_400_not_500() -> None:
    async with running_app() as h:
        headers = {**auth(), "Content-Type": "application/json"}
        for raw in (b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"prompt": NaN}'):
            resp = await h.client.post("/v1/completions", content=raw, headers=headers)
            assert_error(resp, 400)
        raw = b'{"prompt": "x", "temperature": NaN}'
        resp = await h.client.post("/v1/completions", content=raw, headers=headers)
        assert_error(resp, 400, "temperature")
        raw = b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}'
        resp = await h.client.post("/v1/completions", content=raw, headers=headers)
        assert_error(resp, 400, "prompt")


async def test_413_body_too_large() -> None:
    async with running_app(max_body_bytes=2048) as h:
        resp = await h.complete(prompt="x" * 5000)
        assert assert_error(resp, 413)["code"] == "request_too_large"

        async def chunks():  # no Content-Length: counted while reading
            for _ in range(10):
                yield b"x" * 1000

        resp = await h.client.post("/v1/completions", content=chunks(), headers=auth())
        assert_error(resp, 413)


async def test_unknown_route_and_method_have_error_shape() -> None:
    async with running_app() as h:
        assert_error(await h.client.get("/metrics"), 404)  # metrics live on their own port
        assert_error(await h.client.get("/v1/nothing"), 404)
        assert_error(await h.client.get("/v1/completions", headers=auth()), 405)


async def test_503_while_draining() -> None:
    async with running_app() as h:
        h.service.draining = True
        resp = await h.complete(prompt="x", max_tokens=2)
        assert assert_error(resp, 503)["code"] == "draining"
        assert "Retry-After" in resp.headers
        assert_error(await h.client.get("/ready"), 503)
        assert (await h.client.get("/health")).status_code == 200
        assert_error(await h.client.post("/v1/sessions", headers=auth()), 503)


async def test_503_while_loading() -> None:
    import threading

    from tests.app.fake_engine import FakeEngine

    gate = threading.Event()

    def slow_factory() -> FakeEngine:
        gate.wait(5)
        return FakeEngine()

    from pathlib import Path

    import httpx

    from app.main import create_app
    from app.settings import Settings
    from tests.app.harness import two_tenants

    app = create_app(Settings(model=Path("m")), two_tenants(), engine_factory=slow_factory)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert_error(await client.get("/ready"), 503)
            resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth())
            assert assert_error(resp, 503)["code"] == "not_ready"
            gate.set()
