"""The metrics port: Prometheus text with the DESIGN.md names, and the acceptance JSON."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.metrics_app import build_metrics_app
from tests.app.harness import KEY_B, running_app
from tests.design_metrics import COUNTERS_AND_GAUGES, HISTOGRAMS

pytestmark = pytest.mark.anyio

DESIGN_NAMES = {f"{h}_bucket" for h in HISTOGRAMS} | COUNTERS_AND_GAUGES


async def test_metrics_text_parses_and_counts() -> None:
    async with running_app() as h:
        await h.complete(prompt="hello", max_tokens=12, stream=True)
        await h.complete(KEY_B, prompt="hello", max_tokens=5)
        await h.client.post("/v1/sessions", headers={"Authorization": f"Bearer {KEY_B}"})
        metrics_app = build_metrics_app(h.service)
        transport = httpx.ASGITransport(app=metrics_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
            resp = await client.get("/metrics")
            acceptance = await client.get("/admin/acceptance")
            assert (await client.get("/v1/models")).status_code == 404
        assert resp.status_code == 200
        samples = {}
        for family in text_string_to_metric_families(resp.text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        names = {name for name, _ in samples}
        assert DESIGN_NAMES <= names
        assert (
            samples[("mtpserve_requests_total", (("status", "length"), ("tenant", "alpha")))] == 1
        )
        assert samples[("mtpserve_completion_tokens_total", (("tenant", "beta"),))] == 5
        assert samples[("mtpserve_sessions_active", (("tenant", "beta"),))] == 1
        assert samples[("mtpserve_time_to_first_token_seconds_count", ())] == 2
        steps = samples[("mtpserve_spec_verify_steps_total", ())]
        accepted = samples[("mtpserve_spec_accepted_tokens_total", ())]
        first = samples[("mtpserve_spec_accepted_tokens_per_position_total", (("position", "0"),))]
        assert steps > 0 and 0 < first <= steps and accepted >= first
        assert samples[("mtpserve_kv_blocks_total", ())] == 1000
        assert samples[("mtpserve_decode_steps_total", (("budget", "chain-2"),))] > 0
        assert "hello" not in resp.text  # no prompt text anywhere
        assert acceptance.status_code == 200 and acceptance.json()["per_depth"] == [0.5, 0.25]


async def test_a_failed_engine_step_is_counted() -> None:
    async with running_app() as h:
        h.engine.step_delay_s = 0.01
        h.engine.fail_next_step = True  # a plain exception: every request in the engine is lost
        assert (await h.complete(prompt="x", max_tokens=8)).status_code == 500
        metrics_app = build_metrics_app(h.service)
        transport = httpx.ASGITransport(app=metrics_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
            text = (await client.get("/metrics")).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("mtpserve_engine_step_failures_total", ())] == 1
        assert samples[("mtpserve_engine_step_failure_requests_total", (("outcome", "lost"),))] == 1
        assert samples[("mtpserve_engine_step_failure_requests_total", (("outcome", "resumed"),))] == 0
