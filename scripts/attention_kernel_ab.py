"""Two versions of the tree-MLA attention kernel side by side on a GPU (a diagnosis tool).

``--baseline`` is another version of ``engine/kernels/tree_mla_attention.py`` as a file, e.g.
``git show b99ffbb^:engine/kernels/tree_mla_attention.py > /tmp/old_attn.py`` (the kernel
before rows were packed token x head). Two parts, both on random inputs of a training preset's
sizes:

1. the kernel alone (``--micro``): each verify shape of ``SHAPES`` with the baseline's default
   tile and the current kernel at each tile of ``TILES``, checked against the PyTorch reference,
   timed with ``triton.testing.do_bench`` (shapes under ~50 us are launch-bound from Python);
2. engine steps: an adaptive engine over random weights per kernel (each captures its CUDA
   graphs with its kernel), then the start-up arm calibration (every captured arm at every
   batch bucket, context ``--context``) run ``--reps`` times, the engines alternating, medians.

    PYTHONPATH=. python scripts/attention_kernel_ab.py OUT --baseline /tmp/old_attn.py --micro

Writes OUT/attention_ab.json (``micro`` rows of microseconds, ``raw`` and ``summary`` of the
engine steps: batch:arm, baseline ms, current ms, their ratio).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_step_profile import random_adaptive_engine  # noqa: E402

import bench.gpu_kernels as gk  # noqa: E402
import engine.kernels.tree_mla_attention as current  # noqa: E402
from engine.spec.adaptive import NO_SPEC, budget_label  # noqa: E402
from engine.spec.arm_calibration import calibrate_arms  # noqa: E402
from scripts.random_weights import preset_config  # noqa: E402

# (batch, new tokens per sequence, context): decode rows, chains, trees, a prefill chunk.
SHAPES = [(256, 1, 128), (256, 5, 128), (256, 9, 128), (256, 33, 128), (128, 5, 128), (64, 5, 128),
          (64, 16, 128), (64, 33, 128), (16, 33, 128), (4, 33, 128), (1, 33, 64), (1, 5, 64), (1, 1, 64),
          (256, 5, 400), (256, 1, 400), (64, 64, 0)]  # fmt: skip
TILES = [(64, 16, 4), (64, 16, 8), (64, 32, 8), (32, 16, 4), (128, 16, 8), (128, 32, 8), (32, 32, 4), (16, 16, 4)]


def load_baseline(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_tree_mla_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def micro(baseline: ModuleType, heads: int) -> list[dict]:
    rows = []
    for batch, tree, ctx in SHAPES:
        inputs = gk.build_attention_inputs(batch, tree, ctx, heads, seed=7 + batch + tree)
        ref = gk.attention_reference(**inputs).float()
        row: dict = {"batch": batch, "tree": tree, "ctx": ctx}
        runs = [("baseline:default", baseline.tree_mla_attention, {})]
        runs += [(f"current:{m}x{n}x{w}", current.tree_mla_attention, dict(block_m=m, block_n=n, num_warps=w))
                 for m, n, w in TILES]  # fmt: skip
        runs.append(("current:default", current.tree_mla_attention, {}))
        for key, fn, kw in runs:
            try:
                got = fn(**inputs, **kw).float()
                ok = bool(((got - ref).abs() <= 2e-2 + 2e-2 * ref.abs()).all())
                us = gk.bench_ms(partial(fn, **inputs, **kw)) * 1e3
                row[key] = round(us, 1) if ok else f"WRONG {us:.1f}"
            except Exception as exc:  # e.g. a tile out of shared memory
                row[key] = f"ERR {type(exc).__name__}: {str(exc)[:80]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def engine_steps(baseline: ModuleType, preset: str, context: int, reps: int) -> dict:
    kernels = {"baseline": baseline.tree_mla_attention, "current": current.tree_mla_attention}
    engines = {}
    for name, fn in kernels.items():  # each engine captures its graphs with its kernel
        current.tree_mla_attention = fn
        start = time.perf_counter()
        engines[name] = random_adaptive_engine(preset, torch.device("cuda"), 256)
        print(f"{name}: engine built in {time.perf_counter() - start:.0f} s", flush=True)
    current.tree_mla_attention = kernels["current"]
    raw: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for rep in range(reps):
        for name in list(engines) if rep % 2 == 0 else list(engines)[::-1]:
            for t in calibrate_arms(engines[name], NO_SPEC, prompt_tokens=context, kinds=(False,)):
                raw[name].setdefault(f"{t.batch_size}:{budget_label(t.arm)}", []).append(t.seconds * 1e3)
    summary = []
    for key, base in raw["baseline"].items():
        b, c = statistics.median(base), statistics.median(raw["current"][key])
        summary.append((key, round(b, 3), round(c, 3), round(c / b, 3)))
        print(f"{key:22s} baseline {b:7.3f} current {c:7.3f} ms  current/baseline {c / b:.3f}", flush=True)
    return {"raw": raw, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--baseline", type=Path, required=True, help="another tree_mla_attention.py")
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--micro", action="store_true", help="also time the kernel alone")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = preset_config(args.preset)
    gk.RANK, gk.ROPE, gk.BLOCK_SIZE = cfg.kv_lora_rank, cfg.qk_rope_head_dim, 16  # the engine's page
    baseline = load_baseline(args.baseline)
    result: dict = {"preset": args.preset, "baseline": str(args.baseline)}
    if args.micro:
        result["micro"] = micro(baseline, cfg.num_attention_heads)
        (args.out / "attention_ab.json").write_text(json.dumps(result, indent=1))
    result.update(engine_steps(baseline, args.preset, args.context, args.reps))
    (args.out / "attention_ab.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
