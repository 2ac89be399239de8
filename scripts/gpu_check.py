"""GPU check of the fast path on one model: CUDA graphs vs eager, speculation vs autoregressive.

Greedy tokens must be identical (float32) with and without CUDA graphs and with and without
speculation; then tokens/s at batch 1 and 8 for each. Writes JSON to the folder given.

    python scripts/gpu_check.py OUT_DIR [--model models/demo]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from train.heldout import heldout_prompts


def _timed(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> tuple[list, float]:  # type: ignore[type-arg]
    eng.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = eng.generate(prompts, sp)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return outs, sum(len(o.token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(max_batch_size=8, kv_memory_bytes=2 << 30)
    variants = {
        "ar-eager": (SpecConfig(method="none"), EngineConfig(max_batch_size=8, kv_memory_bytes=2 << 30, cuda_graphs=False)),
        "ar-graphs": (SpecConfig(method="none"), cfg),
        "tree-eager": (SpecConfig(method="tree"), EngineConfig(max_batch_size=8, kv_memory_bytes=2 << 30, cuda_graphs=False)),
        "tree-graphs": (SpecConfig(method="tree"), cfg),
        "chain-graphs": (SpecConfig(method="chain"), cfg),
    }
    report: dict[str, object] = {"device": torch.cuda.get_device_name(0), "model": args.model}
    prompts: list[list[int]] | None = None
    base: list[list[int]] | None = None
    for name, (spec, ecfg) in variants.items():
        t0 = time.perf_counter()
        eng = LLMEngine.from_pretrained(args.model, device="cuda", dtype="float32", spec=spec,
                                        engine_config=ecfg)
        build_s = time.perf_counter() - t0
        if prompts is None:
            prompts = heldout_prompts(args.model, eng.tokenizer, 8, 64)  # type: ignore[arg-type]
        row: dict[str, object] = {"build_s": round(build_s, 2)}
        if eng.static_forward is not None:
            row["graphs"] = eng.static_forward.use_graphs
            row["capture_error"] = eng.static_forward.capture_error
        for batch in (1, 8):
            outs, tps = _timed(eng, prompts[:batch], sp)
            tokens = [o.token_ids for o in outs]
            if batch == 8:
                if base is None:
                    base = tokens
                row["greedy_equal_to_ar_eager"] = tokens == base
                row["mean_accepted_length"] = sum(o.stats.mean_accepted_length for o in outs) / 8
            row[f"tokens_per_s_b{batch}"] = round(tps, 1)
            row[f"rollback_ms_last_step_b{batch}"] = round(eng.last_timings.rollback * 1e3, 4)
        report[name] = row
        print(name, row, flush=True)
        del eng
        torch.cuda.empty_cache()
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
