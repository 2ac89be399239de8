"""Streaming load generator: async httpx clients against ``/v1/completions``.

Two ways to load the server for ``duration_s`` seconds:
- ``concurrency=N`` (closed loop): N clients, each sends its next request when the last ends;
- ``rate=R`` (open loop): requests arrive as a Poisson process of R per second, whatever the
  server's state.
Requests are streamed (SSE) with ``ignore_eos`` so every request asks for the same number of
tokens, and ``include_usage`` so the last chunk carries the token count and speculation stats.
Each request records its send time, the arrival time of every content chunk and its end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestRecord:
    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float | None = None
    output_tokens: int = 0
    accepted_length: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class LoadSpec:
    url: str
    api_key: str
    prompts: list[list[int]]
    max_tokens: int
    duration_s: float
    concurrency: int | None = None
    rate: float | None = None
    temperature: float = 0.0
    drain_timeout_s: float = 300.0


async def one_request(client: httpx.AsyncClient, spec: LoadSpec, prompt: list[int], seed: int) -> RequestRecord:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if spec.temperature > 0:
        body["seed"] = seed
    rec = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", spec.url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {spec.api_key}"}) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {str(obj['error'])[:200]}"
                    break
                choices = obj.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    rec.chunk_times.append(time.perf_counter())
                usage = obj.get("usage")
                if usage:
                    rec.output_tokens = int(usage["completion_tokens"])
                    rec.accepted_length = (usage.get("speculative") or {}).get("mean_accepted_length")
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.end = time.perf_counter()
    if rec.error is None and not rec.chunk_times:
        rec.error = "no content chunk received"
    return rec


async def run_load(spec: LoadSpec) -> tuple[list[RequestRecord], float]:
    """All request records and the elapsed time (first send to last completion)."""
    if (spec.concurrency is None) == (spec.rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    counter = itertools.count()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + spec.duration_s

        def next_request() -> asyncio.Task[RequestRecord]:
            i = next(counter)
            return asyncio.ensure_future(one_request(client, spec, spec.prompts[i % len(spec.prompts)], i))

        if spec.concurrency is not None:
            async def worker() -> list[RequestRecord]:
                done = []
                while time.perf_counter() < deadline:
                    done.append(await next_request())
                return done

            per_worker = await asyncio.wait_for(
                asyncio.gather(*(worker() for _ in range(spec.concurrency))),
                spec.duration_s + spec.drain_timeout_s)
            records = [r for w in per_worker for r in w]
        else:
            assert spec.rate is not None
            rng = random.Random(0)
            tasks = []
            while (now := time.perf_counter()) < deadline:
                tasks.append(next_request())
                await asyncio.sleep(min(rng.expovariate(spec.rate), max(deadline - now, 0.0)))
            records = list(await asyncio.wait_for(asyncio.gather(*tasks), spec.drain_timeout_s))
        ends = [r.end for r in records if r.end is not None]
        elapsed = (max(ends) if ends else time.perf_counter()) - t0
    return records, elapsed
