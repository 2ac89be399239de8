"""Open-batch load without a server (a diagnosis tool; ``mtpserve bench serve`` gives the
figures): keep ``--concurrency`` requests in flight, each finished one replaced by the next
held-out prompt, and time rounds of ``--requests`` requests, alternating the autoregressive
engine and the adaptive one (same weights). Prints each round's output tokens/s, the ratio, and
the adaptive engine's steps, seconds and tokens per decode budget (``prefill-only``: a step that
only prefilled), to see where a round's time went.

    PYTHONPATH=. python scripts/open_load.py [--model models/demo] [--concurrency 8]
        [--requests 64] [--rounds 4] [--max-tokens 64] [--temperature 0]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bench.prompts import load_prompts
from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig


def run_round(
    eng: LLMEngine, prompts: list[list[int]], first: int, args: argparse.Namespace
) -> tuple[float, dict[str, list[float]]]:
    """One round: output tokens/s and, per decode budget, [steps, seconds, tokens]."""
    per_budget: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    sent = done = tokens = 0
    start = time.perf_counter()
    while done < args.requests:
        while eng.num_running + eng.num_waiting < args.concurrency and sent < args.requests:
            eng.add_request(f"r{first + sent}", prompts[(first + sent) % len(prompts)], sp)
            sent += 1
        t0 = time.perf_counter()
        outs = eng.step()
        entry = per_budget[eng.last_decode_budget or "prefill-only"]
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
        entry[2] += sum(len(o.new_token_ids) for o in outs)
        for out in outs:
            if out.finished:
                done += 1
                tokens += out.num_generated
    return tokens / (time.perf_counter() - start), per_budget


def spent(per_budget: dict[str, list[float]]) -> str:
    """Steps, seconds and tokens per decode budget, on one line."""
    return "  ".join(
        f"{k}: {int(v[0])} steps {v[1]:.2f} s {int(v[2])} tok" for k, v in sorted(per_budget.items())
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(max_batch_size=max(args.concurrency, 1))
    base = LLMEngine.from_pretrained(
        args.model, device="cpu", spec=SpecConfig(method="none"), engine_config=config
    )
    adaptive = LLMEngine(base.model, base.tokenizer, base.eos_token_ids, SpecConfig(method="adaptive"), config,
                         base.device)  # fmt: skip
    vocab = base.model_config.vocab_size
    prompts, source = load_prompts(
        args.model, base.tokenizer, vocab, 4 * args.requests, args.prompt_tokens
    )
    print(f"{source} prompts, {args.concurrency} in flight, {args.requests} requests a round")
    for r in range(args.rounds):
        first = r * args.requests
        ar, base_budget = run_round(base, prompts, first, args)
        ad, per_budget = run_round(adaptive, prompts, first, args)
        print(
            f"round {r}: none {ar:.1f} tok/s, adaptive {ad:.1f} tok/s ({ad / ar:.2f}x)\n"
            f"  baseline  {spent(base_budget)}\n  adaptive  {spent(per_budget)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
