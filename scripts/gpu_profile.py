"""Where a graphed speculative step spends its time on the GPU (a diagnosis tool).

Times, for one model in bf16 at a few batch sizes: the replay of the draft+verify+accept graph,
the rollback graph, a whole engine step on the graphed path (host work included), and the same
for the CUDA-graph autoregressive step; then profiles one eager draft+verify+accept pass with
torch.profiler and writes the top kernels. Output: OUT/gpu_profile.json and OUT/kernels.txt;
with ``--host-profile-batch B`` also a cProfile of steady engine steps at batch B
(OUT/host_ar_bB.txt, OUT/host_tree_bB.txt); with ``--catch-up`` the MTP catch-up over the
prompts at each batch size (what a switch to drafting costs: ms, and per row), the steady
autoregressive step of an adaptive engine (its choice made, then overruled to no speculation:
what adaptive's AR steps cost beyond the baseline's; also host-profiled), and a torch profile of
one catch-up of ``--catch-up-profile-batch`` prompts (OUT/catch_up_profile.txt); with
``--closed-rounds`` closed batches as the benchmark runs them, autoregressive and adaptive
alternating (``closed_bB`` in the JSON: tokens/s and step ms per round, adaptive's choices);
with ``--step-phases`` where a steady tree step's wall time goes at each batch size
(``phases_bB``: scheduling, the choice, the batch split, the input load, the graph launches,
the wait for the device, ``_finish``'s host work, the engine's per-sequence loop); with
``--timeline`` one request alone at batch 1, step by step, for the autoregressive, tree and
adaptive engines (``timeline_<mode>_p<i>``: each step's ms, budget, catch-up and tokens: what a
request pays beyond its steady steps).

    PYTHONPATH=. python scripts/gpu_profile.py OUT [--model models/demo]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from train.heldout import heldout_prompts


def _event_ms(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _start_steady(eng: LLMEngine, prompts: list[list[int]], warm_steps: int = 4) -> None:
    """Admit ``prompts`` (greedy, 400 tokens each) and run the prefill and first steps, so
    that the next steps are steady decode steps; waits for the device."""
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{time.time_ns()}-{i}", p, sp)
    for _ in range(warm_steps):
        eng.step()
    torch.cuda.synchronize()


def _steady_step_ms(eng: LLMEngine, prompts: list[list[int]], steps: int = 12) -> float:
    _start_steady(eng, prompts)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in list(eng._requests):
        eng.abort_request(rid)
    return ms


def _adaptive_kept_autoregressive(eng: LLMEngine) -> LLMEngine:
    """``eng`` (adaptive) making its choice every step, then decoding autoregressively."""
    from engine.spec.adaptive import NO_SPEC

    assert eng.adaptive is not None
    choose = eng.adaptive.arms.choose
    eng.adaptive.arms.choose = lambda *a, **k: (choose(*a, **k), NO_SPEC)[1]  # type: ignore[method-assign]
    return eng


def _catch_up_profile(eng: LLMEngine, prompts: list[list[int]]) -> str:
    """torch.profiler table (CPU and CUDA) of one catch-up over freshly prefilled prompts."""
    from torch.profiler import ProfilerActivity, profile

    assert eng.drafter is not None
    for i, prompt in enumerate(prompts):
        eng.add_request(f"cp{time.time_ns()}-{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    while any(s.in_prefill for s in eng.scheduler.running) or eng.scheduler.num_waiting:
        eng.step()
    seqs = [s for s in eng.scheduler.running if not s.in_prefill]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.drafter.catch_up(seqs)
        torch.cuda.synchronize()
    for rid in list(eng._requests):
        eng.abort_request(rid)
    averages = prof.key_averages()
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    head = f"{len(prompts)} prompts; CUDA kernels: {kernels}\n"
    return (head + averages.table(sort_by="self_cpu_time_total", row_limit=45)
            + "\n\nBy CUDA time:\n" + averages.table(sort_by="cuda_time_total", row_limit=30))


def _catch_up_ms(eng: LLMEngine, prompts: list[list[int]], eager: bool = False) -> dict[str, float]:
    """The MTP catch-up over freshly prefilled prompts (an adaptive engine leaves it to the first
    drafting step): milliseconds, rows and milliseconds per row, best of 3. ``eager``: without
    the engine's captured catch-up shapes (``engine.spec.graphed_catch_up``)."""
    from engine.spec.adaptive import NO_SPEC

    assert eng.adaptive is not None and eng.drafter is not None
    eng.adaptive.choose = lambda *a, **k: NO_SPEC  # type: ignore[method-assign]
    static = eng.drafter.static_catch_up
    if eager:
        eng.drafter.static_catch_up = None
    best, rows = float("inf"), 0
    for _ in range(3):
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"c{time.time_ns()}-{i}", p, sp)
        while any(s.in_prefill for s in eng.scheduler.running) or eng.scheduler.num_waiting:
            eng.step()
        seqs = [s for s in eng.scheduler.running if not s.in_prefill]
        rows = sum(len(s.tokens) - 1 - s.mtp_committed[0] for s in seqs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.drafter.catch_up(seqs)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3)
        for rid in list(eng._requests):
            eng.abort_request(rid)
    eng.drafter.static_catch_up = static
    prefix = "eager_" if eager else ""
    return {f"{prefix}catch_up_ms": best, "rows": rows, f"{prefix}ms_per_row": best / max(rows, 1)}


def _closed_rounds(ar: LLMEngine, adaptive: LLMEngine, prompts: list[list[int]], rounds: int = 4) -> dict[str, object]:
    """Closed batches as the offline benchmark runs them (``bench.engine_run.run_batch``, 64 new
    tokens), the two engines alternating, the first of each round alternating too: per round
    tokens/s and mean decode-step ms of each, and what adaptive chose and measured. Where the
    sweep finds adaptive's autoregressive steps dearer than the baseline's, this says whether a
    closed batch reproduces it outside the sweep."""
    from bench.engine_run import run_batch

    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rows: dict[str, list[list[float]]] = {"ar": [], "adaptive": []}
    for r in range(rounds + 1):  # round 0: warm-up
        pair = [("ar", ar), ("adaptive", adaptive)]
        for name, eng in pair if r % 2 == 0 else pair[::-1]:
            run = run_batch(eng, prompts, sp)
            if r:
                rows[name].append([run.output_tokens / run.wall_s, run.decode_s / max(run.decode_steps, 1) * 1e3])
            if name == "adaptive":
                arms, costs = run.steps_per_arm, run.arm_costs
    return {"tokens_per_s_and_step_ms": rows, "adaptive_steps_per_arm": arms, "adaptive_arm_costs": costs}


def _host_profile(eng: LLMEngine, prompts: list[list[int]], steps: int = 24) -> str:
    """cProfile of ``steps`` steady decode steps (host work: where a large batch's step goes)."""
    import cProfile
    import io
    import pstats

    _start_steady(eng, prompts, warm_steps=5)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    for rid in list(eng._requests):
        eng.abort_request(rid)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    return text.getvalue()


def _step_phases(eng: LLMEngine, prompts: list[list[int]], steps: int = 12) -> dict[str, float]:
    """Mean milliseconds per steady tree step in each part of it. Wrappers on the engine's and
    the runner's methods (instance attributes, this diagnosis only) read the clock; the one in
    ``_finish`` waits for the device first, so the wait and the host work are told apart (the
    step would wait there anyway, on its device -> host copy)."""
    g = eng.graphed_tree
    assert g is not None
    spent: dict[str, float] = {}

    def timed(owner: object, name: str, wait: bool = False) -> None:
        fn = getattr(owner, name)

        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            if wait:
                t = time.perf_counter()
                torch.cuda.synchronize()
                spent["device_wait"] = spent.get("device_wait", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out

        setattr(owner, name, run)

    timed(eng.scheduler, "schedule")
    timed(eng.batch_choice, "choose")
    for name in ("_split_graphed", "_graphed_step"):
        timed(eng, name)
    for name in ("run", "_load_inputs"):
        timed(g, name)
    timed(g, "_finish", wait=True)
    _start_steady(eng, prompts)
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    for rid in list(eng._requests):
        eng.abort_request(rid)
    for owner, names in ((eng.scheduler, ["schedule"]), (eng.batch_choice, ["choose"]),
                         (eng, ["_split_graphed", "_graphed_step"]), (g, ["run", "_load_inputs", "_finish"])):  # fmt: skip
        for name in names:
            delattr(owner, name)  # the class's methods again
    ms = {k: v / steps * 1e3 for k, v in spent.items()}
    row = {
        "step": total / steps * 1e3,
        "schedule": ms["schedule"],
        "choose": ms["choose"],
        "split_batch": ms["_split_graphed"],
        "load_inputs": ms["_load_inputs"],
        "launch": ms["run"] - ms["_load_inputs"] - ms["device_wait"] - ms["_finish"],
        "device_wait": ms["device_wait"],
        "finish_host": ms["_finish"],
        "engine_loop": ms["_graphed_step"] - ms["run"],
    }
    row["other"] = row["step"] - sum(v for k, v in row.items() if k != "step")
    return row


def _timeline(eng: LLMEngine, prompt: list[int], max_tokens: int = 64) -> list[dict[str, object]]:
    """One request alone, as the benchmark's batch-1 point runs it (after a warm-up request):
    per engine step, its wall time (device work included), whether it prefilled, the budget it
    decoded with, whether it caught the MTP modules up, and the tokens it emitted. Where a
    request's time goes beyond its steady steps: the prefill, the catch-up, the last step."""
    from bench.engine_run import run_batch

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run_batch(eng, [prompt], sp)  # warm-up: graphs uploaded, adaptive arms measured
    rows: list[dict[str, object]] = []
    with eng.closed_batch():
        eng.add_request(f"t{time.time_ns()}", list(prompt), sp)
        torch.cuda.synchronize()
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = eng.step()
            torch.cuda.synchronize()
            rows.append({
                "ms": (time.perf_counter() - t0) * 1e3,
                "budget": eng.last_decode_budget,
                "caught_up": eng._step_caught_up,
                "catch_up_ms": None if eng._catch_up_s is None else eng._catch_up_s * 1e3,
                "tokens": sum(len(o.new_token_ids) for o in outs),
            })  # fmt: skip
    return rows


def _label_phases(g) -> None:  # type: ignore[no-untyped-def]
    """Name the phases of ``g``'s device program in the torch profile (rows ``phase:*``): the
    MTP forwards, the tree growth per depth, the tree selection, the verify forward and the
    acceptance (instance attributes: only this diagnosis sees them)."""
    from torch.profiler import record_function

    def labelled(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            with record_function(f"phase:{name}"):
                return fn(*args, **kwargs)

        return run

    g._mtp_forward = labelled("mtp_forward", g._mtp_forward)
    g._grow = labelled("grow", g._grow)
    g._tree = labelled("select_tree", g._tree)
    g._accept = labelled("accept", g._accept)
    model = g.model
    g.model = type("Labelled", (), {})()
    for name in ("forward_mtp", "lm_head", "mtp_cache_layer"):
        setattr(g.model, name, getattr(model, name))
    g.model.forward_target = labelled("verify_forward", model.forward_target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument(
        "--host-profile-batch", type=int, default=0, help="cProfile steps at this batch"
    )
    parser.add_argument(
        "--catch-up", action="store_true", help="time the MTP catch-up per batch size"
    )
    parser.add_argument(
        "--closed-rounds", action="store_true",
        help="also run closed batches (as the benchmark does) alternating ar and adaptive",
    )  # fmt: skip
    parser.add_argument(
        "--catch-up-profile-batch", type=int, default=1, help="prompts of the profiled catch-up"
    )
    parser.add_argument(
        "--step-phases", action="store_true", help="break a steady tree step's wall time down"
    )
    parser.add_argument(
        "--timeline", action="store_true",
        help="per-step wall times of one batch-1 request for ar, tree and adaptive engines",
    )  # fmt: skip
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cfg = EngineConfig(max_batch_size=max(batches), kv_memory_bytes=4 << 30)
    report: dict[str, object] = {"model": args.model}
    tree = LLMEngine.from_pretrained(
        args.model,
        device="cuda",
        dtype="bfloat16",
        spec=SpecConfig(method="tree"),
        engine_config=cfg,
    )

    def sharing(method: str) -> LLMEngine:  # another engine over the same weights
        return LLMEngine(tree.model, tree.tokenizer, tree.eos_token_ids, SpecConfig(method=method),
                         cfg, tree.device)  # fmt: skip

    ar = sharing("none")
    prompts = heldout_prompts(args.model, tree.tokenizer, 8, 64)  # type: ignore[arg-type]
    g = tree.graphed_tree
    assert g is not None and g.use_graphs, g.capture_error if g else "no graphed tree"
    st = ar.static_forward
    assert st is not None
    adaptive = sharing("adaptive") if args.catch_up else None
    adaptive_ar = _adaptive_kept_autoregressive(sharing("adaptive")) if args.catch_up else None
    for b in batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
        buf = g._buffers[g._bucket(b)]
        ar_buf = st._static[(st._bucket(b), 1)]
        row = {
            "tree_graph_ms": _event_ms(buf.graphs[False].replay),
            "rollback_graph_ms": _event_ms(buf.rollback_graph.replay),  # type: ignore[union-attr]
            "ar_graph_ms": _event_ms(ar_buf.graph.replay),  # type: ignore[union-attr]
            "tree_step_ms": _steady_step_ms(tree, batch_prompts),
            "ar_step_ms": _steady_step_ms(ar, batch_prompts),
        }
        if adaptive is not None and adaptive_ar is not None:
            row.update(_catch_up_ms(adaptive, batch_prompts))
            row.update(_catch_up_ms(adaptive, batch_prompts, eager=True))
            # Interleaved with the baseline's: the host's speed drifts.
            pairs = [(_steady_step_ms(ar, batch_prompts), _steady_step_ms(adaptive_ar, batch_prompts))
                     for _ in range(3)]  # fmt: skip
            row["ar_step_ms_interleaved"] = min(a for a, _ in pairs)
            row["adaptive_ar_step_ms"] = min(d for _, d in pairs)
        report[f"b{b}"] = row
        print(b, row, flush=True)
        if args.step_phases:
            report[f"phases_b{b}"] = _step_phases(tree, batch_prompts)
            print("phases", b, report[f"phases_b{b}"], flush=True)
    if args.timeline:
        engines = {"ar": ar, "tree": tree, "adaptive": sharing("adaptive")}
        for i, prompt in enumerate(prompts[:3]):
            for name, eng in engines.items():
                rows = _timeline(eng, prompt)
                report[f"timeline_{name}_p{i}"] = rows
                total = sum(float(r["ms"]) for r in rows)  # type: ignore[arg-type]
                print("timeline", name, i, f"{total:.2f} ms", [
                    (round(float(r["ms"]), 2), r["budget"], r["tokens"], r["caught_up"]) for r in rows  # type: ignore[arg-type]
                ], flush=True)  # fmt: skip
    if args.host_profile_batch:
        b = args.host_profile_batch
        batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
        engines = [("ar", ar), ("tree", tree)] + (
            [("adaptive_ar", adaptive_ar)] if adaptive_ar else []
        )
        for name, eng in engines:
            (out / f"host_{name}_b{b}.txt").write_text(_host_profile(eng, batch_prompts))
    if adaptive is not None:
        n = args.catch_up_profile_batch
        (out / "catch_up_profile.txt").write_text(
            _catch_up_profile(adaptive, [prompts[i % len(prompts)] for i in range(n)]))
    if args.closed_rounds:
        closed_ar = sharing("none")
        closed_adaptive = sharing("adaptive")
        for b in batches:
            batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
            report[f"closed_b{b}"] = _closed_rounds(closed_ar, closed_adaptive, batch_prompts)
            print("closed", b, report[f"closed_b{b}"], flush=True)
    # Eager profile of one draft+verify+accept pass at batch 1.
    buf = g._buffers[1]
    from torch.profiler import ProfilerActivity, profile

    _label_phases(g)
    with torch.inference_mode():  # as captured: the fused inference kernels apply
        g._draft_verify_accept(buf)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            g._draft_verify_accept(buf)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    report["eager_kernels_b1"] = len(events)
    report["eager_kernel_time_ms_b1"] = sum(e.device_time for e in events) / 1e3
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
    by_count = prof.key_averages().table(sort_by="count", row_limit=80)
    (out / "kernels.txt").write_text(table + "\n\nBy number of calls:\n" + by_count)
    (out / "gpu_profile.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
