"""The real server scraped by a real Prometheus with the shipped settings, all on loopback.

One server and one Prometheus for the module: the server gets a warm-up request (so labelled
series exist before the measured traffic), Prometheus scrapes it, then completions, a stream and
a session produce the traffic every key panel needs. Then, through Prometheus' HTTP API:
the acceptance and latency series were scraped with counts that match the traffic, every PromQL
expression of the shipped dashboards and alert rules parses, and the key panels return data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

# Skips the module until the service lands (the CLI below serves app.main's application).
pytest.importorskip("app.main")

from tests.deploy.conftest import (  # noqa: E402
    PROMETHEUS_DIR,
    as_promql,
    dashboard_exprs,
    load_yaml,
    require_tool,
    rule_exprs,
)

SERVER_CMD = [sys.executable, "-m", "engine.cli", "serve"]
SCRAPE_S = 1.0  # the shipped interval is 5 s; 1 s keeps the test short and changes nothing else
CANARY = "zebra-canary-5b1f"  # prompt text that must never reach a log line (invariant 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(
    check: Callable[[], bool],
    what: str,
    timeout: float,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            pytest.fail(f"{what}: process exited with {proc.returncode}\n{tail}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout} s")


@dataclass
class Stack:
    api: str
    prometheus: str
    key: str
    server: subprocess.Popen
    server_log: Path
    session_zeroed_bytes: int
    completions: int

    def query(self, expr: str) -> httpx.Response:
        return httpx.post(f"{self.prometheus}/api/v1/query", data={"query": expr}, timeout=10)

    def vector(self, expr: str) -> list[dict[str, Any]]:
        response = self.query(expr)
        assert response.status_code == 200, f"{expr}: {response.text}"
        return response.json()["data"]["result"]

    def value(self, expr: str) -> float:
        result = self.vector(expr)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])


def _start_server(tmp: Path, model_dir: Path, key: str) -> tuple[subprocess.Popen, Path, int, int]:
    tenants = tmp / "tenants.toml"
    tenants.write_text(
        f'[tenants.acme]\napi_key_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
    )
    api_port, metrics_port = _free_port(), _free_port()
    env = {
        k: v for k, v in os.environ.items() if k != "MTPSERVE_MODEL"
    }  # it would override --model
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = tmp / "server.log"
    proc = subprocess.Popen(
        [
            *SERVER_CMD,
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(api_port),
            "--metrics-port",
            str(metrics_port),
            "--tenants",
            str(tenants),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    return proc, log, api_port, metrics_port


def _start_prometheus(tmp: Path, metrics_port: int) -> tuple[subprocess.Popen, Path, str]:
    """Prometheus with the shipped config, only the targets and intervals changed."""
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    port = _free_port()
    interval = f"{SCRAPE_S:g}s"  # the timeout may not exceed the interval
    config["global"].update(
        scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval
    )
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    targets = {"mtpserve": f"127.0.0.1:{metrics_port}", "prometheus": f"127.0.0.1:{port}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        job.pop("scrape_interval", None)
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    proc = subprocess.Popen(
        [
            require_tool("prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return proc, log, f"http://127.0.0.1:{port}"


def _complete(
    client: httpx.Client, model: str, prompt: str, max_tokens: int = 8, stream: bool = False
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            # Read to the end: leaving early would abort the request on the server.
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert len(events) > 2 and events[-1] == "data: [DONE]"
    else:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text


def _traffic(stack: Stack, client: httpx.Client) -> None:
    model = client.get("/v1/models").json()["data"][0]["id"]
    _complete(client, model, f"Warm-up {CANARY}", max_tokens=4)
    # Labelled series (tenant, status, position) now exist; wait for a scrape that has them, so
    # the traffic below shows as an increase to rate() rather than as a series' first sample.
    _wait_for(
        lambda: bool(stack.vector("mtpserve_requests_total")), "first scrape after warm-up", 30
    )
    time.sleep(SCRAPE_S * 1.5)
    for i in range(2):
        _complete(client, model, f"Tell me about the number {i}. {CANARY}", stream=i == 0)
    session = client.post("/v1/sessions", json={})
    assert session.status_code == 200, session.text
    sid = session.json()["id"]
    for turn in ("First turn.", f"Second turn {CANARY}."):
        response = client.post(
            f"/v1/sessions/{sid}/completions",
            json={"prompt": turn, "max_tokens": 4, "temperature": 0},
        )
        assert response.status_code == 200, response.text
    closed = client.delete(f"/v1/sessions/{sid}").json()
    assert closed["closed"] is True and closed["zeroed_bytes"] > 0
    stack.session_zeroed_bytes = closed["zeroed_bytes"]
    stack.completions = 1 + 2 + 2


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    try:  # tests/conftest.py provides it: a tiny model folder with a tokenizer
        demo_model_dir: Path = request.getfixturevalue("demo_model_dir")
    except pytest.FixtureLookupError:
        pytest.skip("needs the demo_model_dir fixture (tests/conftest.py)")
    tmp = tmp_path_factory.mktemp("prometheus-integration")
    key = secrets.token_urlsafe(24)
    server, server_log, api_port, metrics_port = _start_server(tmp, demo_model_dir, key)
    prom, prom_log, prom_url = _start_prometheus(tmp, metrics_port)
    api = f"http://127.0.0.1:{api_port}"
    try:
        _wait_for(
            lambda: httpx.get(f"{api}/ready").status_code == 200,
            "server /ready",
            120,
            server,
            server_log,
        )
        _wait_for(
            lambda: httpx.get(f"{prom_url}/-/ready").status_code == 200,
            "prometheus ready",
            30,
            prom,
            prom_log,
        )
        s = Stack(api, prom_url, key, server, server_log, 0, 0)
        # A scrape before any traffic, so counters start at zero in the database.
        _wait_for(
            lambda: bool(s.vector('up{job="mtpserve"} == 1')),
            "first scrape of mtpserve",
            30,
            prom,
            prom_log,
        )
        with httpx.Client(
            base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as client:
            _traffic(s, client)
        # The whole traffic scraped, then one more scrape so rate() windows end after it.
        _wait_for(
            lambda: s.value("sum(mtpserve_requests_total)") >= s.completions, "traffic scraped", 30
        )
        time.sleep(SCRAPE_S * 1.5)
        yield s
    finally:
        for proc in (prom, server):
            if proc.poll() is None:
                proc.terminate()
        for proc in (prom, server):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_acceptance_and_latency_series_were_scraped(stack: Stack) -> None:
    drafted = stack.value("sum(mtpserve_spec_draft_tokens_total)")
    steps = stack.value("sum(mtpserve_spec_verify_steps_total)")
    accepted = stack.value("sum(mtpserve_spec_accepted_tokens_total)")
    assert drafted > 0 and steps > 0 and 0 <= accepted <= drafted
    assert stack.vector("mtpserve_spec_accepted_tokens_per_position_total")
    # One first token per request, and at least as many inter-token gaps as requests (>= 4 tokens).
    assert stack.value("sum(mtpserve_time_to_first_token_seconds_count)") >= stack.completions
    assert stack.value("sum(mtpserve_inter_token_latency_seconds_count)") >= stack.completions
    assert stack.value("sum(mtpserve_e2e_request_latency_seconds_count)") >= stack.completions
    assert stack.value('sum(mtpserve_requests_total{tenant="acme"})') >= stack.completions
    # The metric counts at least what the session's DELETE reported zeroing.
    assert stack.value("sum(mtpserve_kv_zeroed_bytes_total)") >= stack.session_zeroed_bytes


def test_every_dashboard_and_rule_expression_parses(stack: Stack) -> None:
    exprs = [(f"{f}: {title}", as_promql(e)) for f, title, e in dashboard_exprs()]
    exprs += [(f"alerts: {name}", e) for name, e in rule_exprs()]
    assert len(exprs) > 20
    bad = {}
    for where, expr in exprs:
        response = stack.query(expr)
        if response.status_code != 200:  # a parse error answers 400 with errorType bad_data
            bad[where] = response.json().get("error")
    assert bad == {}


def test_rules_evaluate_without_errors(stack: Stack) -> None:
    def rules() -> list[dict[str, Any]]:
        groups = httpx.get(f"{stack.prometheus}/api/v1/rules").json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    _wait_for(lambda: all(r["health"] != "unknown" for r in rules()), "rules evaluated", 15)
    assert {r["name"] for r in rules()} == {name for name, _ in rule_exprs()}
    assert [(r["name"], r.get("lastError")) for r in rules() if r["health"] != "ok"] == []


# Panel title -> check on each returned value. "Returns data" means a non-empty vector whose
# values are finite and plausible, not merely a successful query.
KEY_PANELS: dict[str, Callable[[float], bool]] = {
    "Acceptance rate": lambda v: 0 <= v <= 1,
    "Acceptance by draft position": lambda v: 0 <= v <= 1,
    "Mean accepted length": lambda v: v >= 1,
    "Output tokens/s": lambda v: v > 0,
    "Time to first token": lambda v: v > 0,
    "Inter-token latency": lambda v: v > 0,
    "Running and waiting requests": lambda v: v >= 0,
    "KV cache usage": lambda v: v >= 0,
    "Requests by tenant": lambda v: v > 0,
    "KV bytes zeroed": lambda v: v > 0,
}


@pytest.mark.parametrize("title", list(KEY_PANELS))
def test_key_panels_return_data(stack: Stack, title: str) -> None:
    exprs = [e for _, t, e in dashboard_exprs() if t == title]
    assert exprs, f"no panel titled {title!r}"
    for expr in exprs:
        result = stack.vector(as_promql(expr))
        assert result, f"{title}: no data for {expr}"
        values = [float(sample["value"][1]) for sample in result]
        assert all(math.isfinite(v) and KEY_PANELS[title](v) for v in values), (title, values)


def test_logs_hold_audit_events_and_no_prompt_text(stack: Stack) -> None:
    log = stack.server_log.read_text()
    events = []
    for line in log.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    assert any(isinstance(e, dict) and e.get("event") == "kv_zeroed" for e in events)
    assert CANARY not in log and stack.key not in log


def test_sigterm_drains_and_exits_within_the_grace_period(stack: Stack) -> None:
    # docker-compose.yml gives mtpserve stop_grace_period: 60s before SIGKILL.
    stack.server.send_signal(signal.SIGTERM)
    assert stack.server.wait(timeout=30) == 0
