"""``mtpserve bench serve``: the same streaming load with speculation on and off.

Either starts the server itself (once per ``--spec-methods`` entry, same flags otherwise) or
targets a running server at ``--url`` (then the one setting is labelled by ``--label``). Per
setting: TTFT, inter-token latency (gap between content chunks; a speculative step may deliver
several tokens in one chunk), TPOT ((last chunk - first chunk) / (tokens - 1)) and end-to-end
latency at p50/p90/p99, output tokens/s, requests/s, goodput (requests/s meeting both SLO limits)
and errors, which must be zero.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.prompts import load_prompts
from bench.serve_load import LoadSpec, RequestRecord, run_load
from bench.serve_server import ServerProcess
from bench.stats import percentiles


@dataclass
class ServeSettings:
    model: str
    url: str | None = None
    api_key: str | None = None
    label: str = "external"
    spec_methods: list[str] = field(default_factory=lambda: ["adaptive", "none"])
    device: str = "cpu"
    server_args: list[str] = field(default_factory=list)
    threads: int | None = None  # torch CPU threads of a server started here
    concurrency: int | None = 4
    rate: float | None = None
    duration_s: float = 30.0
    max_tokens: int = 64
    prompt_tokens: int = 64
    num_prompts: int = 32
    temperature: float = 0.0
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0


def summarize_records(records: list[RequestRecord], elapsed: float, slo_ttft_ms: float,
                      slo_tpot_ms: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.end is not None]
    ttft = [r.chunk_times[0] - r.start for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
            for r in ok if r.output_tokens > 1]
    e2e = [r.end - r.start for r in ok]  # type: ignore[operator]
    good = [r for r in ok if (r.chunk_times[0] - r.start) * 1e3 <= slo_ttft_ms and (
        r.output_tokens <= 1 or (r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) * 1e3 <= slo_tpot_ms)]
    tokens = sum(r.output_tokens for r in ok)
    accepted = [r.accepted_length for r in ok if r.accepted_length]
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(errors),
        "error_samples": sorted(set(errors))[:5], "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else None,
        "output_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "goodput_requests_per_s": len(good) / elapsed if elapsed > 0 else None,
        "goodput_fraction": len(good) / len(records) if records else None,
        "ttft_ms": percentiles(ttft, scale=1e3), "itl_ms": percentiles(itl, scale=1e3),
        "tpot_ms": percentiles(tpot, scale=1e3), "e2e_ms": percentiles(e2e, scale=1e3),
        "mean_accepted_length": sum(accepted) / len(accepted) if accepted else None,
    }


def _prompts(s: ServeSettings) -> tuple[list[list[int]], str]:
    folder = Path(s.model)
    tokenizer = None
    if any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    return load_prompts(folder, tokenizer, vocab, s.num_prompts, s.prompt_tokens)


def _load_once(s: ServeSettings, url: str, key: str, prompts: list[list[int]]) -> dict[str, Any]:
    spec = LoadSpec(url=url, api_key=key, prompts=prompts, max_tokens=s.max_tokens,
                    duration_s=s.duration_s, concurrency=None if s.rate else s.concurrency,
                    rate=s.rate, temperature=s.temperature)
    records, elapsed = asyncio.run(run_load(spec))
    return summarize_records(records, elapsed, s.slo_ttft_ms, s.slo_tpot_ms)


def run_serve(s: ServeSettings, log_dir: Path | None = None, echo: Any = print) -> dict[str, Any]:
    """The ``serve`` section of a results file."""
    prompts, source = _prompts(s)
    load_start = list(os.getloadavg())
    runs = []
    if s.url:
        key = s.api_key or os.environ.get("MTPSERVE_API_KEY", "")
        runs.append({"spec_method": s.label, **_load_once(s, s.url, key, prompts)})
    for method in [] if s.url else s.spec_methods:
        log_path = (log_dir / f"serve-{method}.log") if log_dir else None
        echo(f"serve: starting server with --spec-method {method} ...")
        with ServerProcess(s.model, method, s.device, s.server_args, log_path,
                           threads=s.threads) as server:
            echo(f"serve: {s.duration_s:.0f} s of load ({'rate ' + str(s.rate) if s.rate else f'concurrency {s.concurrency}'})")
            runs.append({"spec_method": method, **_load_once(s, server.url, server.key, prompts)})
        r = runs[-1]
        echo(f"serve[{method}]: {r['completed']} requests, {r['errors']} errors, "
             f"{r['output_tokens_per_s'] or 0:.1f} tok/s, TTFT p50 {r['ttft_ms']['p50'] or 0:.0f} ms, "
             f"TPOT p50 {r['tpot_ms']['p50'] or 0:.1f} ms")
    settings = asdict(s)
    settings.pop("api_key", None)
    settings["load"] = f"rate {s.rate}/s (Poisson)" if s.rate else f"concurrency {s.concurrency}"
    settings["prompts"] = source
    return {"settings": settings, "runs": runs, "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg())}
