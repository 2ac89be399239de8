"""Where the autoregressive decode step's time goes, greedy against sampled (a diagnosis tool).

The sampled baseline of the H200 sweeps took ~1.9 ms per token at batch 1 against ~1.0 greedy,
and the adaptive engine's start-up calibration timed its sampled autoregressive step 0.4 ms
(batch 1) to 1.8 ms (batch 256) above the greedy one. For each temperature and batch size this
times steady autoregressive steps of one engine (wall clock, the device waited for), then
profiles a few with torch.profiler (host and device) and cProfile, and writes:
OUT/ar_step_profile.json (ms per step, device kernels and their time per step, host syncs per
step) and OUT/ar_step_profile.txt (the profiler tables, the cProfile of the sampled steps).

Runs on a trained folder (``--model``) or, with ``--random-preset gpu``, on random weights of a
preset's shape (no training: what a step costs does not depend on the weights)::

    PYTHONPATH=. python scripts/ar_step_profile.py OUT --random-preset gpu --device cuda

``--methods none,adaptive`` profiles an adaptive engine's steps too, on the same weights and
batches (each row says which budgets its timed steps took: on random weights nothing drafted is
accepted, so adaptive speculation decodes autoregressively). Session 30's H200 trace had the
adaptive engine's autoregressive steps at batch 256 slower than the baseline's (1.2-1.4 against
0.9 ms in a round where it never drafted; its measured cost of them 1.9 ms), but a probe on
random weights then had the baseline's own second run as slow: this separates device work from
host work for each engine, on the same machine state.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path
from typing import cast

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.params import SpecMethod
from engine.spec.adaptive import NO_SPEC
from scripts.random_weights import random_model


def random_engine(preset: str, device: torch.device, max_batch: int, methods: list[SpecMethod]) -> list[LLMEngine]:
    """Engines of each speculation method (``SpecConfig.method``) over the same random bf16
    weights of a training preset's shape."""
    model = random_model(preset, device)
    return [LLMEngine(model, None, frozenset(), SpecConfig(method=m),
                      EngineConfig(max_batch_size=max_batch, kv_memory_bytes=4 << 30), device)
            for m in methods]  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _start(eng: LLMEngine, batch: int, temperature: float, tag: str) -> list[str]:
    vocab = eng.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    room = min(400, eng.max_model_len - 64)
    sp = SamplingParams(max_tokens=room, temperature=temperature, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, torch.randint(3, vocab, (64,), generator=gen).tolist(), sp)
    while eng.num_waiting or any(s.in_prefill for s in map(eng.sequence, ids) if s is not None):
        eng.step()
    for _ in range(4):
        eng.step()
    _sync(eng.device)
    return ids


def profile_point(eng: LLMEngine, batch: int, temperature: float, steps: int) -> tuple[dict, str]:
    from torch.profiler import ProfilerActivity, profile

    method = eng.spec.method
    ids = _start(eng, batch, temperature, f"{method}-t{temperature}-b{batch}")
    arms: dict[str, int] = {}
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
        arms[str(eng.last_decode_budget)] = arms.get(str(eng.last_decode_budget), 0) + 1
    _sync(eng.device)
    ms = (time.perf_counter() - t0) / steps * 1e3
    prof_steps = 5
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(prof_steps):
            eng.step()
        _sync(eng.device)
    cpu_prof = cProfile.Profile()
    cpu_prof.enable()
    for _ in range(steps):
        eng.step()
    _sync(eng.device)
    cpu_prof.disable()
    for rid in ids:
        eng.abort_request(rid)
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    host_calls = {e.key: e.count / prof_steps for e in events
                  if e.key in ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize",
                               "aten::item", "aten::_local_scalar_dense", "cudaGraphLaunch",
                               "aten::to", "aten::copy_", "cudaLaunchKernel")}  # fmt: skip
    row = {
        "method": method, "arms": arms, "batch": batch, "temperature": temperature,
        "ms_per_step": round(ms, 3),
        "device_kernels_per_step": len(kernels) / prof_steps,
        "device_ms_per_step": round(sum(e.device_time for e in kernels) / 1e3 / prof_steps, 3),
        "host_calls_per_step": host_calls,
    }
    text = io.StringIO()
    pstats.Stats(cpu_prof, stream=text).sort_stats("cumulative").print_stats(30)
    tables = (f"==== {method} T={temperature} batch={batch}: {row}\n"
              + events.table(sort_by="cpu_time_total", row_limit=35)
              + "\n-- by count\n" + events.table(sort_by="count", row_limit=30)
              + "\n-- cProfile\n" + text.getvalue())  # fmt: skip
    return row, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", help="a trained model folder")
    parser.add_argument("--random-preset", help="random weights of this training preset's shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--methods", default="none", help="speculation methods profiled, e.g. none,adaptive")
    parser.add_argument("--adaptive-autoregressive", action="store_true",
                        help="pin adaptive speculation to autoregressive steps (like for like with the baseline)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    methods = [cast(SpecMethod, m) for m in args.methods.split(",")]
    if args.model:
        first = LLMEngine.from_pretrained(
            args.model, device=args.device, dtype="bfloat16" if device.type == "cuda" else "float32",
            spec=SpecConfig(method=methods[0]),
            engine_config=EngineConfig(max_batch_size=max(batches), kv_memory_bytes=4 << 30),
        )  # fmt: skip
        engines = [first] + [LLMEngine(first.model, first.tokenizer, first.eos_token_ids, SpecConfig(method=m),
                                       first.config, first.device) for m in methods[1:]]  # fmt: skip
    else:
        engines = random_engine(args.random_preset or "gpu", device, max(batches), methods)
    if args.adaptive_autoregressive:
        for eng in engines:
            if eng.adaptive is not None:
                eng.adaptive.forced = NO_SPEC  # every step autoregressive; no prompt caught up for drafting
    rows, texts = [], []
    for b in batches:
        for t in (float(x) for x in args.temperatures.split(",")):
            for eng in engines:  # the methods side by side at each point
                row, text = profile_point(eng, b, t, args.steps)
                print(json.dumps(row), flush=True)
                rows.append(row)
                texts.append(text)
    (args.out / "ar_step_profile.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "ar_step_profile.txt").write_text("\n\n".join(texts))


if __name__ == "__main__":
    main()
