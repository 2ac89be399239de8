"""Validate the tree simulator against measured decoding on a model (issue 9).

1. Measure acceptance statistics per depth and sibling rank with a wide tree on one set of
   held-out prompts (the simulator's input).
2. On *other* held-out prompts, measure the mean accepted length of several speculation shapes.
3. Predict each with the simulator and report the relative error of the mean accepted length
   and of the speedup over autoregressive decoding (the latency model is the one the adaptive
   scheduler calibrates at start-up: real target and MTP forwards timed on this device).

Chains have a fixed shape, so their prediction is exact up to sampling noise; the engine's
dynamic trees change shape every step, so they are compared with the optimal shape of the same
budget (what the planner assumes).

    python scripts/validate_simulator.py --model models/demo --out bench/results/simulator-validation-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.spec.adaptive import calibrate_latency
from engine.spec.drafter import TreeBudget
from engine.simulator import AcceptanceStats, optimal_tree
from engine.simulator.tree_shape import TreeShape
from engine.simulator.validation import MeasuredRun, prediction_errors
from train.heldout import heldout_prompts

SHAPES: list[tuple[str, SpecConfig, TreeShape | None]] = [
    ("chain-2", SpecConfig(method="chain", num_draft_tokens=2), TreeShape.chain(2)),
    ("chain-4", SpecConfig(method="chain", num_draft_tokens=4), TreeShape.chain(4)),
    ("chain-6", SpecConfig(method="chain", num_draft_tokens=6), TreeShape.chain(6)),
    ("tree-2x5-8", SpecConfig(method="tree", topk=2, depth=5, num_draft_tokens=8), None),
    ("tree-3x5-12", SpecConfig(method="tree", topk=3, depth=5, num_draft_tokens=12), None),
]


def _tokens_per_s(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams, rounds: int = 2) -> float:
    """Best of ``rounds`` batched generations (the test prompts as one batch)."""
    best = 0.0
    for _ in range(rounds):
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = eng.generate(prompts, sp)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="bench/results/simulator-validation-cpu.json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    # Small engines: fewer CUDA-graph buckets to capture on GPU.
    load = {"device": args.device, "dtype": args.dtype,
            "engine_config": EngineConfig(max_batch_size=max(args.prompts, 1))}

    probe = LLMEngine.from_pretrained(args.model, spec=SpecConfig(method="none"), **load)
    prompts = heldout_prompts(args.model, probe.tokenizer, 2 * args.prompts, prompt_tokens=64)  # type: ignore[arg-type]
    calib, test = prompts[: args.prompts], prompts[args.prompts :]
    report: dict[str, object] = {"model": args.model, "device": args.device, "loadavg": os.getloadavg(), "runs": {}}
    for temperature in (0.0, 1.0):
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=0)
        wide = LLMEngine.from_pretrained(
            args.model, spec=SpecConfig(method="tree", topk=3, depth=6, num_draft_tokens=16), **load
        )
        wide.generate(calib, sp)
        stats = AcceptanceStats.from_dict(wide.acceptance_snapshot())
        # The latency model the adaptive scheduler uses: real forwards timed on this device.
        latency = calibrate_latency(wide, TreeBudget(topk=3, depth=6, num_draft_tokens=16))
        ar = LLMEngine.from_pretrained(args.model, spec=SpecConfig(method="none"), **load)
        ar_tps = _tokens_per_s(ar, test, sp)
        runs = []
        for name, spec, shape in SHAPES:
            eng = LLMEngine.from_pretrained(args.model, spec=spec, **load)
            start = time.perf_counter()
            outs = eng.generate(test, sp)
            elapsed = time.perf_counter() - start
            steps = sum(o.stats.num_steps for o in outs)
            accepted = sum(o.stats.num_accepted_tokens for o in outs)
            measured = 1 + accepted / max(steps, 1)
            speedup = _tokens_per_s(eng, test, sp) / ar_tps
            budget = spec.num_draft_tokens or 0
            predicted_shape = shape or optimal_tree(stats, budget, max_depth=spec.depth)
            runs.append(MeasuredRun(name, predicted_shape, len(test), measured, speedup))
            print(f"T={temperature} {name}: measured {measured:.3f} in {elapsed:.1f}s, "
                  f"speedup {speedup:.2f}", flush=True)
        result = prediction_errors(stats, latency, runs)
        print(result.format(), flush=True)
        report["runs"][f"T={temperature}"] = {  # type: ignore[index]
            "stats": wide.acceptance_snapshot(),
            "rows": [
                {
                    "name": r.run.name,
                    "measured_mean_accepted_length": r.run.mean_accepted_length,
                    "predicted_mean_accepted_length": r.predicted_length,
                    "relative_error": r.length_error,
                    "measured_speedup": r.run.speedup,
                    "predicted_speedup": r.predicted_speedup,
                    "speedup_relative_error": r.speedup_error,
                }
                for r in result.rows
            ],
            "mean_abs_relative_error": result.mean_abs_length_error,
            "mean_abs_speedup_relative_error": result.mean_abs_speedup_error,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
