"""How the graphed decode steps' cost depends on the context, and where their device time goes
(a diagnosis tool).

The adaptive engine calibrates each captured arm's step time at start-up over scratch prompts
of a few tokens (``engine.spec.arm_calibration``); the H200's batch-256 trace then ran chain-4
steps at 6.3-6.5 ms against the 3.93 ms calibrated. This times every arm (no speculation, the
chain, the tree) at each batch size for scratch prompts of each ``--contexts`` length, with
the calibration's own code, and profiles steady steps of chosen (batch, context, arm) points
with torch.profiler: device kernels per step, device ms per step, the top kernels by time.

Random weights of a preset's shape (what a step costs does not depend on the weights; the
acceptance does, so every step is a full tree accepting little)::

    PYTHONPATH=. python scripts/spec_step_profile.py OUT --random-preset gpu

Writes OUT/spec_step_profile.json and OUT/spec_step_profile.txt (the kernel tables).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.model.config import ModelConfig
from engine.spec.adaptive import NO_SPEC, budget_label
from engine.spec.arm_calibration import calibrate_arms
from engine.spec.drafter import TreeBudget
from scripts.random_weights import random_model


def random_adaptive_engine(preset: str, device: torch.device, max_batch: int,
                           drafting_layer: bool | None = None) -> LLMEngine:
    """An adaptive engine (its arms captured, not calibrated) over random weights of a
    training preset's shape."""
    model = random_model(preset, device)
    config = EngineConfig(max_batch_size=max_batch, kv_memory_bytes=(8 << 30) if device.type == "cuda" else 1 << 28,
                          cuda_graphs=True, calibrate_arms=False, drafting_layer=drafting_layer)  # fmt: skip
    return LLMEngine(model, None, frozenset(), SpecConfig(method="adaptive"), config, device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def arm_table(eng: LLMEngine, contexts: list[int]) -> list[dict]:
    """The start-up calibration's step times (greedy) for scratch prompts of each length."""
    rows = []
    for ctx in contexts:
        t0 = time.perf_counter()
        timings = calibrate_arms(eng, NO_SPEC, prompt_tokens=ctx, kinds=(False,))
        print(f"context {ctx}: {len(timings)} timings in {time.perf_counter() - t0:.1f} s", flush=True)
        rows += [{"context": ctx, "batch": t.batch_size, "arm": budget_label(t.arm),
                  "ms": round(t.seconds * 1e3, 3)} for t in timings]  # fmt: skip
    return rows


def profile_point(
    eng: LLMEngine, batch: int, context: int, arm: TreeBudget, steps: int = 3, sequence: bool = False,
    temperature: float = 0.0, changing: bool = False, host_profile: bool = False,
) -> tuple[dict, str]:
    """Steady steps of ``arm`` forced over ``batch`` random prompts of ``context`` tokens;
    ``sequence``: also list one step's kernels in launch order; ``temperature``: the requests'
    (0: greedy); ``changing``: request ``i`` may generate ``16 + 2 i`` tokens, and the
    steps are timed from the first one after a request finished: most steps' batch is not the
    last one's; ``host_profile``: cProfile the profiled steps again and
    list the host functions taking the most time."""
    from torch.profiler import ProfilerActivity, profile

    adaptive = eng.adaptive
    assert adaptive is not None
    vocab = eng.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch * 1000 + context)
    ids = [f"prof-{batch}-{context}-{budget_label(arm)}-{temperature}-{changing}-{i}" for i in range(batch)]
    try:
        adaptive.forced = NO_SPEC
        for i, rid in enumerate(ids):
            sp = SamplingParams(max_tokens=16 + 2 * i if changing else 200, temperature=temperature,
                                ignore_eos=True)  # fmt: skip
            eng.add_request(rid, torch.randint(3, vocab, (context,), generator=gen).tolist(), sp)
        while eng.num_waiting or any(s.in_prefill for s in map(eng.sequence, ids) if s is not None):
            eng.step()
        adaptive.forced = arm
        for _ in range(4):  # the catch-up after the prefill, then steady steps
            eng.step()
        while changing and eng.num_running == batch:  # until the first request finishes
            eng.step()
        _sync(eng.device)
        running = eng.num_running
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync(eng.device)
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                eng.step()
            _sync(eng.device)
        host_lines = _host_profile(eng, steps) if host_profile else []
    finally:
        adaptive.forced = None
        for rid in ids:
            eng.abort_request(rid)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    per_kernel: dict[str, list[float]] = {}
    for e in kernels:
        per_kernel.setdefault(e.name, []).append(e.device_time)
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:25]
    # The CUDA runtime calls' host time: a launch or copy that blocks (a graph launch behind a
    # full queue, a copy from pageable memory, an allocation) shows here, not among the kernels.
    per_call: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CPU" and e.name.startswith("cuda"):
            per_call.setdefault(e.name, []).append(e.cpu_time_total)
    calls = sorted(per_call.items(), key=lambda kv: -sum(kv[1]))[:10]
    row = {
        "batch": batch, "context": context, "arm": budget_label(arm), "wall_ms": round(wall_ms, 3),
        "temperature": temperature, "changing": changing, "running_at_start": running,
        "kernels_per_step": len(kernels) / steps,
        "device_ms_per_step": round(sum(e.device_time for e in kernels) / 1e3 / steps, 3),
        "top_kernels": [{"name": name[:90], "calls_per_step": len(t) / steps,
                         "us_per_step": round(sum(t) / steps, 1)} for name, t in top],  # fmt: skip
        "runtime_calls": [{"name": name, "calls_per_step": len(t) / steps, "host_us_per_step": round(sum(t) / steps, 1),
                           "max_us": round(max(t), 1)} for name, t in calls],  # fmt: skip
    }
    lines = [f"==== batch {batch} context {context} {row['arm']} T={temperature}"
             f"{f' changing batch from {running}' if changing else ''}: wall {row['wall_ms']} ms, "
             f"device {row['device_ms_per_step']} ms, {row['kernels_per_step']:.0f} kernels per step"]
    lines += [f"  {k['us_per_step']:9.1f} us  {k['calls_per_step']:6.1f}x  {k['name']}" for k in row["top_kernels"]]
    lines.append("---- CUDA runtime calls: host us per step, calls per step, longest call us")
    lines += [f"  {c['host_us_per_step']:9.1f} us  {c['calls_per_step']:6.1f}x  max {c['max_us']:8.1f}  {c['name']}"
              for c in row["runtime_calls"]]  # fmt: skip
    if sequence and len(kernels) >= steps:
        # One step's kernels in launch order (the last profiled step): which of them are the
        # drafting depths' glue, the verify, the acceptance; gaps are idle device time.
        ordered = sorted(kernels, key=lambda e: e.time_range.start)
        per_step = len(ordered) // steps
        last = ordered[-per_step:]
        lines.append(f"---- one step's kernels in order ({per_step}): start offset us, duration us, name")
        t0 = last[0].time_range.start
        lines += [f"  {e.time_range.start - t0:9.1f} {e.device_time:7.1f}  {e.name[:110]}" for e in last]
    return row, "\n".join(lines + host_lines) + "\n"


def _host_profile(eng: LLMEngine, steps: int) -> list[str]:
    """The host functions taking the most time over ``steps`` more steps (cProfile)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    _sync(eng.device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return [f"---- host profile of {steps} more steps (top 25 by own time)", text.getvalue()]


def attention_sweep(model_cfg: ModelConfig, block_size: int) -> list[dict]:
    """The tree-MLA attention kernel's tile configurations at the preset's sizes (heads, latent
    and rope widths, the engine's page size) on the verify shapes of the steps above; each
    checked against the reference."""
    import bench.gpu_kernels as gk
    from engine.kernels.tree_mla_attention import default_tile, tree_mla_attention

    gk.RANK, gk.ROPE, gk.BLOCK_SIZE = model_cfg.kv_lora_rank, model_cfg.qk_rope_head_dim, block_size
    heads = model_cfg.num_attention_heads
    configs: list[dict[str, Any]] = [{"block_m": m, "block_n": n, "num_warps": w}
               for m in (16, 32, 64) for n in (16, 32) for w in (4, 8)]  # fmt: skip
    records = []
    for batch, tree, ctx in [(256, 1, 128), (256, 5, 128), (256, 33, 128), (64, 33, 128), (1, 33, 128),
                             (256, 5, 400)]:  # fmt: skip
        inputs = gk.build_attention_inputs(batch, tree, ctx, heads, seed=7)
        ref = gk.attention_reference(**inputs).float()
        for cfg in configs:
            rec: dict = {"batch": batch, "tree": tree, "ctx": ctx, **cfg}
            try:
                got = tree_mla_attention(**inputs, **cfg).float()
                rec["ok"] = bool(((got - ref).abs() <= 2e-2 + 2e-2 * ref.abs()).all())
                rec["us"] = round(gk.bench_ms(partial(tree_mla_attention, **inputs, **cfg)) * 1e3, 1)
            except Exception as exc:  # e.g. out of shared memory for a large tile
                rec["error"] = repr(exc)[:200]
            records.append(rec)
        mine = records[-len(configs):]
        best = min((r for r in mine if "us" in r), key=lambda r: r["us"], default=None)
        tile = default_tile(model_cfg.kv_lora_rank)
        default = next(r for r in mine if (r["block_m"], r["block_n"], r["num_warps"]) == tuple(tile))
        print(f"attention B={batch} T={tree} ctx={ctx}: default {default.get('us')} us, best {best}", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--random-preset", default="gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--contexts", default="8,64,160,400")
    parser.add_argument("--profile", default="256:128:chain,256:128:none,256:128:tree,1:64:tree,1:64:none",
                        help="batch:context:arm[:temperature[:changing]] points to profile (arm: none, "
                             "chain, tree; the temperature and 'changing' override the flags)")
    parser.add_argument("--temperature", type=float, default=0.0, help="of the profiled requests")
    parser.add_argument("--changing", action="store_true",
                        help="requests finish one per step: no step's batch is the last one's")
    parser.add_argument("--host-profile", action="store_true", help="cProfile each point's steps too")
    parser.add_argument("--sequence", action="store_true",
                        help="also list each profiled step's kernels in launch order")
    parser.add_argument("--drafting-layer", choices=["on", "off", "auto"], default="auto",
                        help="EngineConfig.drafting_layer of the engine (auto: on CUDA in 16 bits)")
    parser.add_argument("--no-sweep", action="store_true",
                        help="only the profiles: no attention tile sweep, no arm table")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    drafting = None if args.drafting_layer == "auto" else args.drafting_layer == "on"
    eng = random_adaptive_engine(args.random_preset, device, args.max_batch, drafting)
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    arms = {}
    for sampled in (False, True):
        tree, chain = sorted(eng.graphed_budgets(sampled), key=lambda b: -b.topk)[:2]
        arms[sampled] = {"none": NO_SPEC, "chain": chain, "tree": tree}
    result: dict = {"preset": args.random_preset, "device": str(device)}
    text = []
    result["profiles"] = []
    for point in args.profile.split(","):
        b, ctx, arm, *rest = point.split(":")
        temperature = float(rest[0]) if rest else args.temperature
        changing = rest[1:] == ["changing"] or args.changing
        row, table = profile_point(eng, int(b), int(ctx), arms[temperature > 0][arm], sequence=args.sequence,
                                   temperature=temperature, changing=changing, host_profile=args.host_profile)
        print(table, flush=True)
        result["profiles"].append(row)
        text.append(table)
        (args.out / "spec_step_profile.json").write_text(json.dumps(result, indent=1))
        (args.out / "spec_step_profile.txt").write_text("".join(text))
    if args.no_sweep:
        return
    if device.type == "cuda":
        result["attention_sweep"] = attention_sweep(eng.model_config, eng.pool.block_size)
        (args.out / "spec_step_profile.json").write_text(json.dumps(result, indent=1))
    result["arm_steps"] = arm_table(eng, [int(c) for c in args.contexts.split(",")])
    (args.out / "spec_step_profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "spec_step_profile.txt").write_text("".join(text))
    by: dict[tuple[int, str], dict[int, float]] = {}
    for r in result["arm_steps"]:
        by.setdefault((r["batch"], r["arm"]), {})[r["context"]] = r["ms"]
    ctxs = [int(c) for c in args.contexts.split(",")]
    print("batch arm " + " ".join(f"ctx{c}" for c in ctxs))
    for (b, arm), v in sorted(by.items()):
        print(f"{b:5d} {arm:12s} " + " ".join(f"{v.get(c, float('nan')):7.2f}" for c in ctxs))


if __name__ == "__main__":
    main()
