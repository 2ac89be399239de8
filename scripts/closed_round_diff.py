"""Where an adaptive engine pinned to autoregressive steps spends more than the baseline over
whole closed batches (a diagnosis tool).

Session 32's H200 trace had the adaptive engine decoding batch 256 autoregressively 4-9% slower
than the baseline per round, though the host time of its steps summed to the baseline's within
0.5%: the difference lay outside the steps or in device work the host did not wait for. For each
batch size this runs closed batches as the benchmark does (``bench.engine_run.run_batch``'s
order: admit every request, step until all finish, wait for the device), alternating the
baseline and an adaptive engine pinned to autoregressive steps (``AdaptiveController.forced``),
and times each round's phases: admitting the requests, the steps that prefilled, the decode
steps, the final wait for the device, and the rest of the loop. Then it profiles one more round
of each with cProfile (host functions: own time per round, the adaptive engine's excess first)
and torch.profiler (device kernels: time and count per round, the excess first). Output:
OUT/closed_round_diff.json and OUT/closed_round_diff.txt.

Random weights of a preset's shape (what an autoregressive round costs does not depend on them)::

    PYTHONPATH=. python scripts/closed_round_diff.py OUT --random-preset gpu --device cuda \\
        --batch-sizes 128,256
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.gc_tuning import settle_heap
from engine.spec.adaptive import NO_SPEC
from scripts.ar_step_profile import random_engine

_ids = iter(range(10**9))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drafting_measured_dear(adaptive: LLMEngine, batches: list[int]) -> None:
    """Every drafting arm of ``adaptive`` measured far dearer than an autoregressive step at
    every batch bucket up to the largest of ``batches``: the engine then chooses autoregressive
    decoding itself, through its real path (its choice, latch and measurements)."""
    controller = adaptive.adaptive
    assert controller is not None
    for sampled in (False, True):
        arms = controller._captured_arms(adaptive, sampled) or [controller.chain, controller._planned_tree(adaptive)]
        for size in sorted({1 << k for k in range(max(batches).bit_length())} | set(batches)):
            for _ in range(5):
                controller.observe(size, NO_SPEC, 1e-3, size, sampled)
                for arm in arms:
                    controller.observe(size, arm, 1.0, 2 * size, sampled)


def closed_round(
    eng: LLMEngine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0
) -> dict[str, float]:
    """One closed batch (greedy, or sampled at ``temperature``), timed by phase (ms)."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    gc.collect()
    _sync(eng.device)
    phases: dict[str, float] = defaultdict(float)
    with eng.closed_batch():
        t0 = time.perf_counter()
        ids = [f"diff-{next(_ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts, strict=True):
            eng.add_request(rid, list(prompt), sp)
        t1 = time.perf_counter()
        phases["admit"] = t1 - t0
        left = set(ids)
        steps = 0
        while left:
            s0 = time.perf_counter()
            outs = eng.step()
            s1 = time.perf_counter()
            prefilled = any(o.step_drafted is None for o in outs)
            phases["prefill_steps" if prefilled else "decode_steps"] += s1 - s0
            steps += 1
            for out in outs:
                if out.finished:
                    left.discard(out.request_id)
        t2 = time.perf_counter()
        _sync(eng.device)
        t3 = time.perf_counter()
    phases["final_wait"] = t3 - t2
    phases["wall"] = t3 - t0
    phases["loop_rest"] = phases["wall"] - sum(phases[k] for k in ("admit", "prefill_steps", "decode_steps", "final_wait"))
    out = {k: round(v * 1e3, 3) for k, v in phases.items()}
    out["steps"] = steps
    return out


def host_profile(
    eng: LLMEngine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0
) -> dict[str, float]:
    """Own host time (ms) per function over one closed round."""
    prof = cProfile.Profile()
    prof.enable()
    closed_round(eng, prompts, new_tokens, temperature)
    prof.disable()
    stats = pstats.Stats(prof)
    own: dict[str, float] = {}
    for (file, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        own[f"{Path(file).name}:{line}({name})"] = tottime * 1e3
    return own


def device_profile(
    eng: LLMEngine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0
) -> dict[str, tuple[float, int]]:
    """Device kernels over one closed round: name -> (ms, count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        closed_round(eng, prompts, new_tokens, temperature)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels[e.name[:80]]
            k[0] += e.device_time / 1e3
            k[1] += 1
    return {name: (round(ms, 3), int(n)) for name, (ms, n) in kernels.items()}


def _excess(a: dict[str, float], b: dict[str, float], limit: int = 25) -> list[tuple[str, float, float]]:
    """Functions by how much more ``b`` spent than ``a``: (name, a, b)."""
    names = set(a) | set(b)
    rows = sorted(((n, a.get(n, 0.0), b.get(n, 0.0)) for n in names), key=lambda r: r[1] - r[2])
    return rows[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--random-preset", default="gpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="128,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy rounds")
    parser.add_argument("--no-device-profile", action="store_true")
    parser.add_argument(
        "--choosing", action="store_true",
        help="the adaptive engine chooses autoregressive steps itself (drafting measured dear at "
        "every batch size) instead of being pinned to them",
    )
    parser.add_argument("--no-latch", action="store_true", help="with --choosing: no latched choice")
    parser.add_argument(
        "--prefill-chunk-tokens", type=int, default=None,
        help="prompt tokens prefilled per step by both engines (the CPU default, 512, fills a batch "
        "of 256 64-token prompts over 32 steps; CUDA's 4096 over 4)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    base, adaptive = random_engine(args.random_preset, device, max(batches), ["none", "adaptive"])
    controller = adaptive.adaptive
    assert controller is not None
    if args.choosing:
        drafting_measured_dear(adaptive, batches)
        if args.no_latch:
            import engine.spec.batch_choice

            engine.spec.batch_choice.AR_LATCH_MIN_BATCH = 1 << 30
    else:
        controller.forced = NO_SPEC  # every step autoregressive, no prompt caught up
    engines = {"ar": base, "adaptive-ar": adaptive}
    if args.prefill_chunk_tokens is not None:
        for eng in engines.values():
            eng.scheduler.prefill_chunk_tokens = args.prefill_chunk_tokens
    vocab = base.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    settle_heap()
    results: dict[str, object] = {
        "device": str(device), "preset": args.random_preset, "temperature": args.temperature, "points": [],
    }
    T = args.temperature
    text = io.StringIO()
    for batch in batches:
        prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, eng in engines.items():
                timed = closed_round(eng, prompts, args.new_tokens, T)
                if r:
                    rounds[name].append(timed)
        medians = {name: {k: round(statistics.median(t[k] for t in rs), 3) for k in rs[0]}
                   for name, rs in rounds.items()}  # fmt: skip
        hosts = {name: host_profile(eng, prompts, args.new_tokens, T) for name, eng in engines.items()}
        point: dict[str, object] = {"batch": batch, "rounds": rounds, "median_ms": medians}
        print(f"batch {batch}: median ms per phase {json.dumps(medians)}", flush=True)
        text.write(f"==== batch {batch}, T={T}\nmedian ms per phase:\n")
        for name, m in medians.items():
            text.write(f"  {name:12s} {json.dumps(m)}\n")
        text.write("host functions, own ms per round, adaptive-ar's excess first (ar, adaptive-ar):\n")
        for n, a, b in _excess(hosts["ar"], hosts["adaptive-ar"]):
            text.write(f"  {b - a:+8.3f}  {a:8.3f} {b:8.3f}  {n}\n")
        text.write(f"  total own time: ar {sum(hosts['ar'].values()):.1f} ms, "
                   f"adaptive-ar {sum(hosts['adaptive-ar'].values()):.1f} ms (under cProfile)\n")
        if not args.no_device_profile and device.type == "cuda":
            kernels = {name: device_profile(eng, prompts, args.new_tokens, T) for name, eng in engines.items()}
            ms = {name: {k: v[0] for k, v in ks.items()} for name, ks in kernels.items()}
            counts = {name: sum(n for _, n in ks.values()) for name, ks in kernels.items()}
            totals = {name: round(sum(m.values()), 3) for name, m in ms.items()}
            point["device_ms"], point["kernels"] = totals, counts
            text.write(f"device kernels per round: ms {totals}, count {counts}; adaptive-ar's excess first:\n")
            for n, a, b in _excess(ms["ar"], ms["adaptive-ar"], 15):
                na = kernels["ar"].get(n, (0, 0))[1]
                nb = kernels["adaptive-ar"].get(n, (0, 0))[1]
                text.write(f"  {b - a:+8.3f}  {a:8.3f} ({na}) {b:8.3f} ({nb})  {n}\n")
        results["points"].append(point)  # type: ignore[attr-defined]
    (args.out / "closed_round_diff.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "closed_round_diff.txt").write_text(text.getvalue())
    print(text.getvalue())


if __name__ == "__main__":
    main()
