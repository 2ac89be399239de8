"""Where an engine step's host time goes, phase by phase, adaptive against the baseline (a
diagnosis tool).

Session 42's traces had the adaptive engine's first step at batch 1 (the prompt's prefill, the
MTP catch-up over it and the first tree step launched) take 3.6-7.9 ms against the baseline's
2.3-2.6 ms for its prefill, in a round of ~17-20 ms: at batch 1 that step alone decides whether
speculation reaches 3x. And at batch 256 the adaptive engine decoding autoregressively lost ~3%
to the baseline in its filling and shrinking steps. This times, on the host clock and without
synchronising (as the benchmark's steps run), each engine's steps and the engine calls inside
them (inclusive times: a call that reads a device result includes the wait for it), for closed
batches as ``bench.engine_run.run_batch`` runs them, alternating the two engines; then writes one
torch.profiler trace of an adaptive round per batch size (host ops and device kernels, gzipped
Chrome trace) for the timeline.

    PYTHONPATH=. python scripts/step_phase_probe.py OUT --model runs/bench/gpu --device cuda \\
        [--batch-sizes 1,256] [--temperature 0] [--rounds 8]

Output: OUT/step_phase_probe.txt (per round: each step's ms and its phases' ms) and
OUT/step_phase_probe.json, OUT/trace-b<B>.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.contenders import load_base
from bench.engine_run import run_batch
from bench.gpu_clock import spin
from bench.prompts import load_prompts
from engine import LLMEngine, SamplingParams, SpecConfig
from engine.gc_tuning import settle_heap
from engine.spec.adaptive import budget_label

# (object path from the engine, method name, label)
_PHASES: tuple[tuple[str, str, str], ...] = (
    ("", "_read_ahead", "read_ahead"),
    ("scheduler", "schedule", "schedule"),
    ("", "_prefill", "prefill"),
    ("static_forward", "run_prefill", "prefill.graph"),
    ("", "_sample_rows", "sample"),
    ("batch_choice", "filled_batch_drafts", "fill_question"),
    ("drafter", "catch_up", "catch_up"),
    ("", "_launch_after_prefill", "launch_after_prefill"),
    ("batch_choice", "choose", "choose"),
    ("", "_autoregressive_step", "ar_step"),
    ("", "_launch_autoregressive", "ar_launch"),
    ("", "_graphed_step", "graphed_step"),
    ("", "_speculative_step", "host_spec_step"),
    ("", "_launch_graphed", "graphed_launch"),
    ("", "_append_tokens", "append_tokens"),
    ("", "_free_released", "free_released"),
    ("_hidden_log", "append", "hidden_log.append"),
    ("_hidden_log", "flush", "hidden_log.flush"),
)


class PhaseClock:
    """Inclusive host seconds per phase label within the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[label] += time.perf_counter() - start
                self.calls[label] += 1

        return timed

    def take(self) -> dict[str, tuple[float, int]]:
        out = {k: (v * 1e3, self.calls[k]) for k, v in self.current.items()}
        self.current.clear()
        self.calls.clear()
        return out


def instrument(eng: LLMEngine, steps: list[dict[str, Any]]) -> None:
    clock = PhaseClock()
    for path, name, label in _PHASES:
        owner = eng if not path else getattr(eng, path, None)
        if owner is None or not hasattr(owner, name):
            continue
        setattr(owner, name, clock.wrap(label, getattr(owner, name)))
    step = eng.step

    def step_timed() -> Any:
        start = time.perf_counter()
        outs = step()
        ms = (time.perf_counter() - start) * 1e3
        decoded = sum(o.step_drafted is not None for o in outs)
        steps.append({
            "ms": ms, "outputs": len(outs), "decoded": decoded,
            "budget": getattr(eng, "last_decode_budget", None), "phases": clock.take(),
        })  # fmt: skip
        return outs

    eng.step = step_timed  # type: ignore[method-assign]


def describe(step: dict[str, Any]) -> str:
    phases = " ".join(f"{k}={ms:.2f}{'' if n == 1 else f'x{n}'}" for k, (ms, n) in
                      sorted(step["phases"].items(), key=lambda kv: -kv[1][0]) if ms >= 0.02)  # fmt: skip
    return f"{step['budget'] or 'P'}:{step['outputs']}:{step['ms']:.2f} [{phases}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,256")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps-shown", type=int, default=8, help="first and last steps printed per round")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler traces")
    parser.add_argument("--profile-tokens", type=int, default=24,
                        help="new tokens per request in the profiled round (its trace stays small)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    base = load_base(args.model, args.device, dtype, max(batches), args.prompt_tokens + args.max_new_tokens, None)
    adaptive = LLMEngine(base.model, base.tokenizer, base.eos_token_ids, SpecConfig(method="adaptive"),
                         base.config, base.device)  # fmt: skip
    adaptive.use_acceptance_prior(args.model)
    prompts, source = load_prompts(args.model, base.tokenizer, base.model_config.vocab_size, max(batches),
                                   args.prompt_tokens)  # fmt: skip
    engines = {"ar": base, "adaptive": adaptive}
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for name, eng in engines.items():
        instrument(eng, steps[name])
    settle_heap()
    lines = [f"model {args.model} on {args.device} ({dtype}), prompts {source}, T={args.temperature}"]
    record: list[dict[str, Any]] = []
    k = args.steps_shown
    for batch in batches:
        batch_prompts = prompts[:batch]
        for r in range(args.rounds + 1):
            sp = SamplingParams(temperature=args.temperature, max_tokens=16 if r == 0 else args.max_new_tokens,
                                ignore_eos=True)  # fmt: skip
            walls = {}
            for name, eng in engines.items():
                steps[name].clear()
                spin(eng.device, 50.0)
                walls[name] = run_batch(eng, batch_prompts, sp).wall_s * 1e3
            lines.append(f"b={batch} {'warm-up' if r == 0 else f'round {r}'}: ar {walls['ar']:.1f} ms, "
                         f"adaptive {walls['adaptive']:.1f} ms, speedup {walls['ar'] / walls['adaptive']:.2f}")  # fmt: skip
            for name in engines:
                s = steps[name]
                shown = s if len(s) <= 2 * k else [*s[:k], None, *s[-k:]]
                lines.append(f"  {name}: {len(s)} steps, {sum(x['ms'] for x in s):.1f} ms in steps")
                lines += ["    " + ("..." if x is None else describe(x)) for x in shown]
            record.append({"batch": batch, "round": r, "walls_ms": walls,
                           "steps": {n: list(steps[n]) for n in engines}})  # fmt: skip
        if not args.no_profile and args.device.startswith("cuda"):
            sp = SamplingParams(temperature=args.temperature, max_tokens=args.profile_tokens, ignore_eos=True)
            spin(adaptive.device, 50.0)
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                run_batch(adaptive, batch_prompts, sp)
            raw = out / f"trace-b{batch}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
                g.write(f.read())
            raw.unlink()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            lines += [f"b={batch} profiled adaptive round, top host ops:", table]
    if adaptive.adaptive is not None:
        lines.append("adaptive steps per arm: " + ", ".join(
            f"{budget_label(b)} {n}" for b, n in adaptive.adaptive.steps_per_arm.items()))  # fmt: skip
    text = "\n".join(lines)
    print(text)
    (out / "step_phase_probe.txt").write_text(text + "\n")
    (out / "step_phase_probe.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
