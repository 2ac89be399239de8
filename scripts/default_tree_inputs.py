"""Measured inputs of the default greedy tree budgets (``engine/spec/default_inputs/``).

The default trees of ``engine/spec/defaults.py`` are what ``derive_default_budget`` (the tree
optimiser at batch 1) picks on these inputs; ``tests/engine/simulator/test_defaults_derivation.py``
holds the constants to it. This script writes the inputs:

``cpu``: measures, on this machine, with the demo model (float32, greedy):
  - acceptance per depth and sibling rank: a full EAGLE-2 tree (top-4, depth 8, every candidate
    kept, no confidence cut) on held-out prompts disjoint from the benchmark's first 8, so every
    accepted node that had children offered all four ranks (``depth_reached`` is then the right
    denominator for every rank) and no pruning or cut biases the deeper depths;
  - a latency model at batch 1: target and MTP forwards timed as the adaptive scheduler's
    start-up calibration does (``calibrate_latency``, on a denser token grid, fastest of several
    calibrations), plus host overheads: per decode step from steady single-sequence
    autoregressive steps, per speculative step and per drafted depth fitted by least squares on
    steady steps of ten full trees from chain-1 to 4x6-16 (``scripts/validate_simulator.py`` fits
    them on two chains only, which proved too noisy here).

H200 (the ``gpu`` preset, bfloat16, graphed steps), in two parts:
  - ``gpu-stats`` measures the acceptance on the H200, as ``cpu`` does (a full top-4, depth-8
    tree) on 32 held-out prompts none of the benchmark's sweep uses (its first 256), with the
    model the benchmark trains (``TREE_STATS=1 scripts/gpu_bench.sh`` runs it there);
  - ``h200-latency`` fits the latency model at batch 1 to a benchmark JSON of fixed shapes
    measured on the H200: each speculative shape's whole graphed greedy step is fixed +
    per_token * tokens + per_depth * depth (least squares over the shapes), the autoregressive
    step verify(1, 1). No GPU needed.

    python scripts/default_tree_inputs.py cpu --threads 2   # ~2 min stats + ~2 min latency
    python scripts/default_tree_inputs.py gpu-stats --model runs/bench/gpu   # on the H200
    python scripts/default_tree_inputs.py h200-latency --shapes bench/results/SHAPES.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

OUT_DIR = Path("engine/spec/default_inputs")


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


# ---- CPU: measured here ---------------------------------------------------------------------


def _steady_step_seconds(eng: Any, prompt: list[int], sp: Any) -> list[float]:
    """Seconds of each steady decode step of one sequence (no prefill, no prompt catch-up)."""
    eng.add_request(f"steady-{time.perf_counter_ns()}", prompt, sp)
    times: list[float] = []
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        outs = eng.step()
        seconds = time.perf_counter() - start
        decode_only = len(outs) == 1 and outs[0].step_drafted is not None
        if decode_only and not eng._step_caught_up and not outs[0].finished:
            times.append(seconds)
    return times


def measure_cpu(args: argparse.Namespace) -> None:
    import torch

    from train.heldout import heldout_prompts
    from train.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(Path(args.model))
    bench_prompts = heldout_prompts(args.model, tokenizer, 8, prompt_tokens=64)
    pool = heldout_prompts(args.model, tokenizer, args.prompts + 16, prompt_tokens=64)
    prompts = [p for p in pool if p not in bench_prompts][: args.prompts]
    load_before = os.getloadavg()
    source = {
        "script": f"scripts/default_tree_inputs.py cpu --part {args.part} --threads {args.threads}",
        "model": args.model,
        "device": "cpu",
        "dtype": "float32",
        "torch_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "commit": args.commit or _commit(),
        "date": datetime.date.today().isoformat(),
        "loadavg_before": list(load_before),
    }
    if args.part in ("stats", "all"):
        _measure_full_tree_stats(
            args.model, prompts, args.max_tokens, {"device": "cpu", "dtype": "float32"}, source,
            args.out_dir / "cpu-demo-greedy-stats.json", excluded="the benchmark's first 8",
        )  # fmt: skip
    if args.part in ("latency", "all"):
        _measure_cpu_latency(args, prompts, source)


def _measure_full_tree_stats(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    load: dict[str, str],
    source: dict[str, Any],
    path: Path,
    excluded: str,
) -> None:
    """Greedy acceptance per depth and rank of a full top-4, depth-8 tree (every candidate kept,
    no cut) over ``prompts`` in one batch, written to ``path``."""
    from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from engine.simulator import AcceptanceStats
    from engine.spec.drafter import TreeBudget

    # A full top-4 tree, depth 8: 4 + 7 * 16 candidates, all kept, no cut.
    topk, depth = 4, 8
    full = TreeBudget(topk=topk, depth=depth, num_draft_tokens=topk + (depth - 1) * topk * topk)
    spec = SpecConfig(
        method="tree",
        topk=topk,
        depth=depth,
        num_draft_tokens=full.num_draft_tokens,
        min_path_prob=0.0,
    )
    wide = LLMEngine.from_pretrained(
        model,
        spec=spec,
        engine_config=EngineConfig(max_batch_size=len(prompts)),
        **load,  # type: ignore[arg-type]
    )
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    wide.generate(prompts, sp)
    snapshot = wide.acceptance_snapshot()
    stats = AcceptanceStats.from_dict(snapshot)
    print(f"acceptance ({time.perf_counter() - start:.1f}s): {snapshot}")
    _write(
        path,
        {
            "source": {
                **source,
                "loadavg_after": list(os.getloadavg()),
                "what": f"greedy acceptance per depth and rank: full EAGLE-2 tree top-{topk}, "
                f"depth {depth}, all {full.num_draft_tokens} candidates kept, min_path_prob 0; "
                f"{len(prompts)} held-out prompts of 64 tokens (not {excluded}), "
                f"{max_tokens} new tokens each, EOS ignored, one batch",
            },
            **snapshot,
            "rank_accept": [list(row) for row in stats.rank_accept],
        },
    )


def _measure_cpu_latency(
    args: argparse.Namespace, prompts: list[list[int]], source: dict[str, Any]
) -> None:
    import engine.spec.adaptive as adaptive
    from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from engine.simulator import LatencyModel
    from engine.spec.drafter import TreeBudget

    load = {"device": "cpu", "dtype": "float32"}
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    full = TreeBudget(topk=4, depth=8, num_draft_tokens=116)

    # Latency at batch 1: forwards on a denser token grid than the scheduler's start-up one.
    one = {"engine_config": EngineConfig(max_batch_size=1), **load}
    grid_tokens = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
    original_grid = adaptive._grid
    adaptive._grid = lambda device, max_batch, max_tokens: [(1, t) for t in grid_tokens]  # type: ignore[assignment]
    try:
        eng = LLMEngine.from_pretrained(args.model, spec=SpecConfig(method="none"), **one)  # type: ignore[arg-type]
        runs = [adaptive.calibrate_latency(eng, full) for _ in range(args.calibrations)]
    finally:
        adaptive._grid = original_grid
    # The fastest of the calibrations per point: other processes only ever add time.
    forwards = LatencyModel.fit(
        {
            key: [
                {"batch_size": 1, "tokens": t, "seconds": min(surface(r)(1, t) for r in runs)}
                for t in grid_tokens
            ]
            for key, surface in (
                ("verify", lambda r: r.verify_seconds),
                ("draft_per_depth", lambda r: r.draft_seconds),
            )
        }
    )
    # Host overheads: steady single-sequence steps of AR and of full trees (every candidate of
    # a TOPKxDEPTH-N budget kept, no cut), prompts interleaved across shapes.
    engines = {
        name: LLMEngine.from_pretrained(args.model, spec=_spec(name), **one)  # type: ignore[arg-type]
        for name in ("ar", *TIMED_SHAPES)
    }
    timing_prompts = prompts[: args.timing_prompts]
    for eng in engines.values():  # warm-up
        _steady_step_seconds(eng, timing_prompts[0], SamplingParams(max_tokens=8, temperature=0.0))
    medians: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for p in timing_prompts:
            for name, eng in engines.items():
                times[name] += _steady_step_seconds(eng, p, sp)
        for name, t in times.items():
            medians[name].append(statistics.median(t))
    # The fastest round's median per shape: other processes only ever add time.
    steady = {name: min(m) for name, m in medians.items()}
    for name, m in medians.items():
        print(f"steady {name}: {steady[name] * 1e3:.3f} ms (round medians {m})")
    decode = max(steady["ar"] - forwards.verify_seconds(1, 1), 0.0)
    # step = forwards + decode + per_step + per_depth * depth, least squares over the shapes
    rows, rest = [], []
    for name in TIMED_SHAPES:
        k, d, n = _parse(name)
        fwd = forwards.verify_seconds(1, n + 1) + forwards.draft_seconds(1, 1)
        fwd += (d - 1) * forwards.draft_seconds(1, k)
        rows.append((1.0, float(d)))
        rest.append(steady[name] - fwd - decode)
    per_step, per_depth = _nonnegative_lstsq(rows, rest)
    latency = forwards.with_overheads(step=per_step, depth=per_depth, decode=decode)
    fit_error = {
        name: (per_step + per_depth * _parse(name)[1] - r) / steady[name]
        for name, r in zip(TIMED_SHAPES, rest, strict=True)
    }
    print("fit error per shape: " + ", ".join(f"{k} {v:+.1%}" for k, v in fit_error.items()))
    _write(
        args.out_dir / "cpu-demo-latency.json",
        {
            "source": {
                **source,
                "loadavg_after": list(os.getloadavg()),
                "what": "batch 1: target and MTP forwards timed by calibrate_latency (best of 3), "
                f"fastest of {args.calibrations} calibrations per point, on tokens "
                + ",".join(map(str, grid_tokens))
                + "; host overheads: decode = steady AR step - verify(1, 1); per step and per "
                "drafted depth fitted by least squares on the steady steps of full TOPKxDEPTH-N "
                f"trees (median over {len(timing_prompts)} single held-out prompts, "
                f"{args.max_tokens} tokens each, shapes interleaved; fastest of {args.rounds} "
                "rounds)",
                "steady_step_seconds": steady,
                "fit_relative_error": fit_error,
            },
            **latency.to_dict(),
        },
    )


# Shapes whose steady steps fit the host overheads: chains 1-8 deep, trees 2-4 wide.
TIMED_SHAPES = (
    "1x1-1",
    "1x2-2",
    "1x4-4",
    "1x6-6",
    "1x8-8",
    "2x3-6",
    "2x6-10",
    "3x5-12",
    "4x2-8",
    "4x6-16",
)


def _parse(name: str) -> tuple[int, int, int]:
    width, rest = name.split("x")
    depth, nodes = rest.split("-")
    return int(width), int(depth), int(nodes)


def _spec(name: str) -> Any:
    from engine import SpecConfig

    if name == "ar":
        return SpecConfig(method="none")
    k, d, n = _parse(name)
    return SpecConfig(method="tree", topk=k, depth=d, num_draft_tokens=n, min_path_prob=0.0)


def _nonnegative_lstsq(rows: list[tuple[float, float]], values: list[float]) -> tuple[float, float]:
    """Least squares ``values ~ a * rows[i][0] + b * rows[i][1]`` with ``a, b >= 0``."""
    import numpy as np

    x, y = np.array(rows), np.array(values)
    a, b = np.linalg.lstsq(x, y, rcond=None)[0]
    if a < 0:
        a, b = 0.0, max(float(x[:, 1] @ y / (x[:, 1] @ x[:, 1])), 0.0)
    elif b < 0:
        a, b = max(float(np.mean(y)), 0.0), 0.0
    return float(a), float(b)


# ---- H200: measured there (acceptance), extracted from a benchmark's JSON (latency) ----------


def measure_gpu_stats(args: argparse.Namespace) -> None:
    """Acceptance of the ``gpu`` preset on a CUDA device (run on the H200 with the model the
    benchmark trains): a full top-4, depth-8 tree, greedy, bf16, on held-out prompts none of
    the benchmark's sweep uses (its first ``--exclude``)."""
    import torch

    from train.heldout import heldout_prompts
    from train.tokenizer import load_tokenizer

    load = {"device": args.device, "dtype": args.dtype}
    tokenizer = load_tokenizer(Path(args.model))
    pool = heldout_prompts(args.model, tokenizer, args.exclude + args.prompts, prompt_tokens=64)
    training = Path(args.model) / "training_log.json"
    source = {
        "script": f"scripts/default_tree_inputs.py gpu-stats --model {args.model} "
        f"--prompts {args.prompts} --exclude {args.exclude} --max-tokens {args.max_tokens}",
        "model": args.model,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "dtype": args.dtype,
        "commit": args.commit or _commit(),
        "date": datetime.date.today().isoformat(),
        "loadavg_before": list(os.getloadavg()),
        "training": _training_summary(training),
    }
    _measure_full_tree_stats(
        args.model, pool[args.exclude :], args.max_tokens, load, source,
        args.out_dir / "h200-gpu-greedy-stats.json",
        excluded=f"the first {args.exclude}, which the benchmark's sweep uses",
    )  # fmt: skip


def _training_summary(path: Path) -> dict[str, Any] | None:
    """What a model folder's ``training_log.json`` says of how far it was trained."""
    if not path.exists():
        return None
    log = json.loads(path.read_text())
    return {key: log.get(key) for key in ("epochs", "timings_s", "final_heldout")}


def extract_h200_latency(args: argparse.Namespace) -> None:
    """The H200 latency model at batch 1 from a benchmark JSON of fixed shapes (``mtpserve bench
    offline --batch-sizes 1 --temperatures 0 --modes chain,tree --tree-budgets K1xD1-N1,...``):
    each speculative shape's graphed greedy step costs ``fixed + per_token * tokens + per_depth *
    depth`` (non-negative least squares over the shapes), the autoregressive step is verify(1,
    1)."""
    import numpy as np

    from engine.spec.defaults import CHAIN_DEPTH

    shapes = json.loads(args.shapes.read_text())
    rows = {
        r["label"]: r
        for r in shapes["runs"]
        if r["batch_size"] == 1 and r["temperature"] == 0.0 and r["mode"] in ("ar", "chain", "tree")
    }

    def tokens_depth(label: str) -> tuple[int, int]:  # (tokens verified, depths drafted)
        if label == "chain":
            return CHAIN_DEPTH + 1, CHAIN_DEPTH
        _, depth, nodes = _parse(label.removeprefix("tree-"))
        return nodes + 1, depth

    labels = sorted(label for label in rows if label != "ar")
    points = [(*tokens_depth(label), rows[label]["step_ms"] / 1e3) for label in labels]
    if len({(t, d) for t, d, _ in points}) < 3:
        raise ValueError(f"{args.shapes}: need 3 speculative shapes at batch 1, T=0; have {labels}")
    x = np.array([[1.0, t, d] for t, d, _ in points])  # [shapes, 3]
    y = np.array([s for _, _, s in points])  # [shapes]
    fixed, per_token, per_depth = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
    if min(fixed, per_token, per_depth) < 0:  # per_token is ~0 on the H200 (latency-bound GEMMs)
        per_token = 0.0
        fixed, per_depth = _nonnegative_lstsq([(1.0, float(d)) for _, d, _ in points], list(y))
    fit_error = {
        label: (fixed + per_token * t + per_depth * d - s) / s
        for label, (t, d, s) in zip(labels, points, strict=True)
    }
    print("fit error per shape: " + ", ".join(f"{k} {v:+.1%}" for k, v in fit_error.items()))
    ar = rows["ar"]["step_ms"] / 1e3
    verify = [{"batch_size": 1, "tokens": 1, "seconds": ar}] + [
        {"batch_size": 1, "tokens": t, "seconds": fixed + per_token * t} for t in (2, 8, 16, 33, 64)
    ]
    _write(
        args.out_dir / "h200-gpu-latency.json",
        {
            "source": {
                "script": f"scripts/default_tree_inputs.py h200-latency --shapes {args.shapes}",
                "from": f"{args.shapes}: step_ms of ar, "
                + ", ".join(labels)
                + " at batch 1, T=0 (graphed greedy steps, bfloat16, commit "
                + shapes["commit"]
                + ")",
                "what": "whole graphed steps: verify(1, 1) is the autoregressive step; a "
                "speculative step of t tokens and d depths costs fixed + per_token * t + "
                "per_depth * d (least squares over the shapes, non-negative); verify(1, t >= 2) "
                "holds fixed + per_token * t, draft_per_depth per_depth",
                "step_ms": {label: rows[label]["step_ms"] for label in ("ar", *labels)},
                "fit": {"fixed": fixed, "per_token": per_token, "per_depth": per_depth},
                "fit_relative_error": fit_error,
            },
            "verify": verify,
            "draft_per_depth": {"fixed": per_depth, "per_token": 0.0},
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="target", required=True)
    cpu = sub.add_parser("cpu", help="measure the demo model's inputs on this CPU")
    cpu.add_argument("--model", default="models/demo")
    cpu.add_argument("--prompts", type=int, default=32)
    cpu.add_argument("--timing-prompts", type=int, default=4)
    cpu.add_argument("--calibrations", type=int, default=5)
    cpu.add_argument("--rounds", type=int, default=2)
    cpu.add_argument("--commit", default=None, help="commit of the code measured (default: HEAD)")
    cpu.add_argument("--max-tokens", type=int, default=128)
    cpu.add_argument("--threads", type=int, default=2)
    cpu.add_argument("--part", choices=("stats", "latency", "all"), default="all")
    cpu.add_argument("--out-dir", type=Path, default=OUT_DIR)
    gpu = sub.add_parser("gpu-stats", help="measure the gpu preset's acceptance on a CUDA device")
    gpu.add_argument("--model", required=True, help="the gpu preset's folder")
    gpu.add_argument("--prompts", type=int, default=32)
    gpu.add_argument("--exclude", type=int, default=256, help="held-out prompts the sweep uses")
    gpu.add_argument("--max-tokens", type=int, default=128)
    gpu.add_argument("--commit", default=None, help="commit of the code measured (default: HEAD)")
    gpu.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    gpu.add_argument("--dtype", default="bfloat16")
    gpu.add_argument("--out-dir", type=Path, default=OUT_DIR)
    lat = sub.add_parser("h200-latency", help="fit the H200 latency model to a benchmark JSON")
    lat.add_argument("--shapes", type=Path, required=True, help="bench offline JSON, batch 1")
    lat.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args()
    {"cpu": measure_cpu, "gpu-stats": measure_gpu_stats, "h200-latency": extract_h200_latency}[
        args.target
    ](args)


if __name__ == "__main__":
    main()
