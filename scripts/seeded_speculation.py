"""Seeded against unseeded sampled requests under speculation, one request at a time (a
diagnosis tool, the CPU figures of the README's session 46 block): per temperature, method and
kind of request, output tokens/s and the mean accepted length, and whether every seeded request
gave the same tokens under every method (its draws are keyed by position: ``engine.keyed_noise``).

    PYTHONPATH=. python scripts/seeded_speculation.py [--model models/demo] [--prompts 16]
        [--max-tokens 64] [--temperatures 0.7,1.0] [--methods none,tree,adaptive]
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import torch

from bench.prompts import load_prompts
from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig


class MethodRun(NamedTuple):
    tokens_per_s: float
    accepted_length: float  # tokens per target forward after the prefill
    outputs: list[list[int]]


def run_method(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> MethodRun:
    """Each prompt alone, one after another (after one warm-up request)."""
    eng.generate(prompts[:1], params[:1])
    start = time.perf_counter()
    outputs, steps, accepted = [], 0, 0
    for prompt, sp in zip(prompts, params, strict=True):
        out = eng.generate([prompt], sp)[0]
        outputs.append(out.token_ids)
        steps += out.stats.num_steps
        accepted += out.stats.num_accepted_tokens
    seconds = time.perf_counter() - start
    return MethodRun(sum(map(len, outputs)) / seconds, 1 + accepted / max(steps, 1), outputs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--methods", default="none,tree,adaptive")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = LLMEngine.from_pretrained(args.model, device="cpu", spec=SpecConfig(method="none"))
    prompts, source = load_prompts(args.model, base.tokenizer, base.model_config.vocab_size,
                                   args.prompts, args.prompt_tokens)  # fmt: skip
    print(f"{source} prompts: {len(prompts)} x {args.prompt_tokens} tokens, {args.max_tokens} new, batch 1")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for seeded in (True, False):
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True,
                                     seed=100 + i if seeded else None) for i in range(len(prompts))]  # fmt: skip
            runs = {}
            for method in args.methods.split(","):
                eng = LLMEngine(base.model, base.tokenizer, base.eos_token_ids, SpecConfig(method=method),  # type: ignore[arg-type]
                                EngineConfig(), base.device)  # fmt: skip
                runs[method] = run_method(eng, prompts, params)
            same = all(r.outputs == next(iter(runs.values())).outputs for r in runs.values())
            cells = "  ".join(f"{m} {r.tokens_per_s:.1f} tok/s (length {r.accepted_length:.2f})" for m, r in runs.items())
            print(f"T={temperature} {'seeded' if seeded else 'unseeded'}: {cells}"
                  + (f"  same tokens under every method: {same}" if seeded else ""), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
