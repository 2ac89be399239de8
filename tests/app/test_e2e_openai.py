"""End to end: the real server (``python -m engine serve``) on free ports, the real LLMEngine on
a tiny model, driven with the official ``openai`` client, httpx and schemathesis."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.tenants import hash_key
from tests.app.test_metrics import DESIGN_NAMES

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "sk-e2e-alpha-key", "sk-e2e-beta-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    metrics_url: str
    model: str
    log: Path
    proc: subprocess.Popen[bytes]
    tenants: Path

    def headers(self, key: str = KEY_A) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.metrics_url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def server(e2e_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2e-server")
    tenants = tmp / "tenants.toml"
    tenants.write_text(
        f'[tenants.alpha]\napi_key_sha256 = "{hash_key(KEY_A)}"\n\n'
        f'[tenants.beta]\napi_key_sha256 = "{hash_key(KEY_B)}"\nmax_concurrent_requests = 4\n'
    )
    port, metrics_port = free_port(), free_port()
    log = tmp / "server.log"
    cmd = [
        sys.executable, "-m", "engine", "serve", "--model", str(e2e_model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--tenants", str(tenants), "--max-model-len", "256", "--drain-timeout-s", "5",
        "--kv-memory-mb", "64",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready in time"
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}).json()
        metrics_url = f"http://127.0.0.1:{metrics_port}"
        yield Server(url, metrics_url, model["data"][0]["id"], log, proc, tenants)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, log.read_text()[-3000:]


def test_openai_completions_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    kw = dict(model=server.model, prompt="Hello there, how are", max_tokens=24, temperature=0)
    plain = client.completions.create(**kw)  # type: ignore[call-overload]
    assert plain.choices[0].finish_reason in ("stop", "length")
    usage = plain.usage.model_dump()
    assert usage["completion_tokens"] >= 1 and "speculative" in usage
    assert usage["speculative"]["num_verify_steps"] >= 1
    chunks = list(client.completions.create(**kw, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_openai_chat_stream_equals_non_stream_with_usage(server: Server) -> None:
    client = server.client(KEY_B)
    messages = [{"role": "user", "content": "Say something."}]
    kw = dict(model=server.model, messages=messages, max_tokens=20, temperature=0)
    plain = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_openai_batch_of_prompts_and_seeded_choices(server: Server) -> None:
    """A batch of prompts answers each as a request of its own would; seeded choice i samples
    with seed + i, so each is what a single request with that seed gives."""
    client = server.client()
    prompts = ["def main(", "import os\n"]
    kw = dict(model=server.model, max_tokens=10, temperature=0)
    batch = client.completions.create(prompt=prompts, **kw)  # type: ignore[call-overload]
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]  # type: ignore[call-overload]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == singles
    kw = dict(model=server.model, prompt="class Config:", max_tokens=12, temperature=1.0)
    seeded = client.completions.create(  # type: ignore[call-overload]
        n=3, seed=7, **kw, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in seeded.choices] == [0, 1, 2]
    for i, choice in enumerate(seeded.choices):
        alone = client.completions.create(seed=7 + i, **kw)  # type: ignore[call-overload]
        assert choice.text == alone.choices[0].text
    generated = sum(len(c.model_extra["token_ids"]) for c in seeded.choices)  # type: ignore[index]
    assert seeded.usage.completion_tokens == generated
    assert len({c.text for c in seeded.choices}) > 1, "three seeds, one text"
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(n=3, seed=7, stream=True, **kw):  # type: ignore[call-overload]
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in seeded.choices]


def test_openai_logprobs_through_the_client(server: Server) -> None:
    """Greedy: each token is its position's most likely one, so the top alternative is the
    token itself, with the same log-probability; chat carries the same shape per token."""
    client = server.client()
    out = client.completions.create(  # type: ignore[call-overload]
        model=server.model, prompt="def main(", max_tokens=8, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) <= 3
        assert top[token] == pytest.approx(logprob) and max(top.values()) == pytest.approx(logprob)
    chat = client.chat.completions.create(  # type: ignore[call-overload]
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
    # Scoring a text as evaluation harnesses do: echo, one new token, the prompt's logprobs.
    scored = client.completions.create(  # type: ignore[call-overload]
        model=server.model, prompt="import os\nimport sys", max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith("import os\nimport sys")
    assert len(lp.tokens) == scored.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


def test_openai_logit_bias_forces_and_bans_tokens(server: Server) -> None:
    client = server.client()
    kw = dict(model=server.model, prompt="def main(", max_tokens=6, temperature=0)
    greedy = client.completions.create(**kw, extra_body={"return_token_ids": True})  # type: ignore[call-overload]
    ids = greedy.choices[0].model_extra["token_ids"]
    forced = client.completions.create(  # type: ignore[call-overload]
        **kw, logit_bias={"42": 100}, extra_body={"return_token_ids": True}
    )
    assert forced.choices[0].model_extra["token_ids"] == [42] * 6
    banned = client.completions.create(  # type: ignore[call-overload]
        **kw, logit_bias={str(ids[0]): -100}, extra_body={"return_token_ids": True}
    )
    assert banned.choices[0].model_extra["token_ids"][0] != ids[0]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw, logit_bias={"99999999": 1})  # type: ignore[call-overload]
    assert info.value.body["param"] == "logit_bias"  # type: ignore[index]
    stopped = client.completions.create(  # type: ignore[call-overload]
        **kw, extra_body={"return_token_ids": True, "stop_token_ids": [ids[2]]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["token_ids"] == ids[: ids.index(ids[2]) + 1]
    held = client.completions.create(  # type: ignore[call-overload]
        **kw, logit_bias={"42": 100},
        extra_body={"return_token_ids": True, "stop_token_ids": [42], "min_tokens": 3},
    )  # fmt: skip
    held_ids = held.choices[0].model_extra["token_ids"]
    assert len(held_ids) == 4 and 42 not in held_ids[:3] and held_ids[3] == 42


def test_edge_sampling_parameters_are_served_not_failed(server: Server) -> None:
    # A temperature of 1e-40 is valid (the schema allows [0, 2]) but overflows the logits when
    # divided by: it had failed the engine step and every request in it (a 500). It decodes
    # greedily now; a top-k at the schema's limit and a nucleus of one token are served too.
    client = server.client()
    kw = dict(model=server.model, prompt="Hello there, how are", max_tokens=12)
    greedy = client.completions.create(**kw, temperature=0)  # type: ignore[call-overload]
    tiny = client.completions.create(**kw, temperature=1e-40)  # type: ignore[call-overload]
    assert tiny.choices[0].text == greedy.choices[0].text
    edges = client.completions.create(  # type: ignore[call-overload]
        **kw, temperature=0.7, top_p=1e-9, extra_body={"top_k": 2**31 - 1}
    )
    assert edges.choices[0].text == greedy.choices[0].text  # one token kept: the argmax


def test_wrong_key_and_validation_through_openai_client(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong").models.list()
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=server.model, prompt="x", n=129)
    assert info.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="not-this-model", prompt="x")


def test_metrics_only_on_metrics_port(server: Server) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 404
    samples = server.metrics()
    assert DESIGN_NAMES <= {name for name, _ in samples}
    assert samples[("mtpserve_kv_blocks_total", ())] > 0
    acceptance = httpx.get(server.metrics_url + "/admin/acceptance", timeout=10)
    assert acceptance.status_code == 200 and isinstance(acceptance.json(), dict)


def _wait_metric(server: Server, check, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        samples = server.metrics()
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_and_zeroes_kv(server: Server) -> None:
    idle = _wait_metric(server, lambda s: s[("mtpserve_requests_running", ())] == 0)
    used_idle = idle[("mtpserve_kv_blocks_used", ())]
    zeroed = idle[("mtpserve_kv_zeroed_bytes_total", ())]
    aborts = idle.get(("mtpserve_requests_total", (("status", "abort"), ("tenant", "alpha"))), 0)
    body = {
        "model": server.model, "prompt": "Tell me a long story", "max_tokens": 200,
        "temperature": 0, "stream": True, "ignore_eos": True,
    }  # fmt: skip
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers()
        ) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 2:
                    break
    key = ("mtpserve_requests_total", (("status", "abort"), ("tenant", "alpha")))
    after = _wait_metric(
        server,
        lambda s: s.get(key, 0) > aborts and s[("mtpserve_kv_blocks_used", ())] == used_idle,
    )
    assert after.get(key, 0) == aborts + 1
    assert after[("mtpserve_kv_blocks_used", ())] == used_idle
    assert after[("mtpserve_kv_zeroed_bytes_total", ())] > zeroed
    # The engine keeps serving.
    ok = server.client().completions.create(model=server.model, prompt="Hi", max_tokens=4)
    assert ok.usage.completion_tokens >= 1


def test_session_turns_match_one_request_and_are_isolated(server: Server) -> None:
    h = server.headers()
    created = httpx.post(server.url + "/v1/sessions", headers=h).json()
    sid = created["id"]
    turn_url = f"{server.url}/v1/sessions/{sid}/completions"
    common = {"temperature": 0, "return_token_ids": True, "ignore_eos": True}
    p1, p2 = [5, 17, 30, 12, 8, 9], [20, 21, 12]  # ids valid in any tiny vocab
    t1 = httpx.post(turn_url, json={"prompt": p1, "max_tokens": 7, **common}, headers=h).json()
    out1 = t1["choices"][0]["token_ids"]
    assert len(out1) == 7
    t2 = httpx.post(turn_url, json={"prompt": p2, "max_tokens": 9, **common}, headers=h).json()
    assert t2["usage"]["prompt_tokens"] == len(p2)  # only the new text is prefilled
    # Reused from the cache: the history but its last token, computed with the new text.
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(p1) + len(out1) - 1
    whole = p1 + out1 + p2
    single = httpx.post(
        server.url + "/v1/completions",
        json={"model": server.model, "prompt": whole, "max_tokens": 9, **common},
        headers=h,
        timeout=60,
    ).json()
    assert single["choices"][0]["token_ids"] == t2["choices"][0]["token_ids"]
    info = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=h).json()
    assert info["num_tokens"] >= len(whole) + 8
    other = server.headers(KEY_B)
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=other).status_code == 404
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=other).status_code == 404
    closed = httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=h).json()
    assert closed == {"id": sid, "closed": True, "zeroed_bytes": closed["zeroed_bytes"]}
    assert closed["zeroed_bytes"] > 0
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=h).status_code == 404
    audit = [line for line in server.log.read_text().splitlines() if '"kv_zeroed"' in line]
    assert any(sid in line for line in audit)


def test_fuzz_openapi_schema_finds_no_5xx(server: Server) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    seen: list[int] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=6, deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:  # type: ignore[no-untyped-def]
                resp = case.call(base_url=server.url, headers=server.headers(), timeout=60)
                seen.append(resp.status_code)
                assert resp.status_code < 500, (case.method, case.path, resp.text[:300])

            try:
                check()
            except Unsatisfiable:  # no negative inputs exist (e.g. GET /health)
                continue
    assert len(seen) > 20
    assert httpx.get(server.url + "/ready").status_code == 200


def test_sighup_reloads_tenants_without_dropping_requests(server: Server) -> None:
    new_key = "sk-e2e-beta-rotated"
    old = server.tenants.read_text()
    server.tenants.write_text(old.replace(hash_key(KEY_B), hash_key(new_key)))
    try:
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while (
            httpx.get(server.url + "/v1/models", headers=server.headers(new_key)).status_code != 200
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (
            httpx.get(server.url + "/v1/models", headers=server.headers(KEY_B)).status_code == 401
        )
        assert httpx.get(server.url + "/v1/models", headers=server.headers()).status_code == 200
    finally:
        server.tenants.write_text(old)
        server.proc.send_signal(signal.SIGHUP)
