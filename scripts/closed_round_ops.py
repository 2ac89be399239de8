"""Counts, not times: the device ops and Python calls each engine step issues, an adaptive engine
that decodes autoregressively against the baseline, over whole closed batches (a diagnosis tool).

On the H200 the adaptive engine decoding a closed batch of 256 autoregressively lost ~3% to the
baseline, in its filling and shrinking steps, by a few milliseconds of host work per round: too
little to time on a busy 2-core CPU, where runs of the same round spread by 10-30%. What host
work costs is close to proportional to what it issues, and that is deterministic: the aten ops
dispatched (each a kernel launch on a GPU, outside the captured graphs) and the Python function
calls made. This counts both per engine step, on the CPU, with the GPU's configuration where it
matters (static-shape steps, 4096-token prefill chunks, steps launched ahead), and prints each
step of a round side by side and the per-round totals by step kind: filling (a prefill with
it), steady, shrinking (after a request finished). The adaptive engine chooses autoregressive
steps itself (every drafting arm measured dear at every batch size), through its real path.

    PYTHONPATH=. python scripts/closed_round_ops.py [--preset tiny] [--batch 256] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from scripts.closed_round_diff import drafting_measured_dear
from scripts.random_weights import random_model


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def engines(preset: str, batch: int, chunk: int) -> dict[str, LLMEngine]:
    """The baseline and an adaptive engine over the same random weights of ``preset``'s shape,
    configured as on the GPU (static steps, overlap, ``chunk``-token prefill chunks); the
    adaptive one has every drafting arm measured far dearer than autoregressive decoding."""
    model = random_model(preset, torch.device("cpu"))
    config = EngineConfig(max_batch_size=batch, kv_memory_bytes=2 << 30, cuda_graphs=True, overlap_steps=True,
                          prefill_chunk_tokens=chunk, calibrate_arms=False)  # fmt: skip
    out = {m: LLMEngine(model, None, frozenset(), SpecConfig(method=m), config, torch.device("cpu"))
           for m in ("none", "adaptive")}  # fmt: skip
    drafting_measured_dear(out["adaptive"], [batch])
    return out


def count_round(
    eng: LLMEngine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0
) -> list[dict[str, Any]]:
    """One closed batch (greedy, or sampled at ``temperature``), as ``bench.engine_run.run_batch``
    runs it: per step, its kind and the ops and Python calls it issued."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    steps: list[dict[str, Any]] = []
    with eng.closed_batch():
        for i, p in enumerate(prompts):
            eng.add_request(f"ops-{id(prompts)}-{i}", p, sp)
        finished = 0
        while eng.has_unfinished_requests():
            filling = eng.num_waiting > 0 or any(s.in_prefill for s in eng.scheduler.running)
            shrinking = finished > 0
            counter, profile = OpCounter(), cProfile.Profile()
            with counter:
                profile.enable()
                outs = eng.step()
                profile.disable()
            by_fn = {f"{fn[0].rsplit('/', 1)[-1]}:{fn[2]}": stat[1]
                     for fn, stat in pstats.Stats(profile).stats.items()}  # type: ignore[attr-defined]
            finished += sum(o.finished for o in outs)
            kind = "filling" if filling else "shrinking" if shrinking else "steady"
            steps.append({"kind": kind, "ops": sum(counter.ops.values()), "calls": sum(by_fn.values()),
                          "by_op": counter.ops, "by_fn": Counter(by_fn)})  # fmt: skip
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens (CUDA's default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy rounds")
    args = parser.parse_args()
    engs = engines(args.preset, args.batch, args.chunk)
    vocab = engs["none"].model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.batch)]
    rounds = {}
    for name, eng in engs.items():
        count_round(eng, prompts, 8, args.temperature)  # warm-up: first calls build plans and caches
        rounds[name] = count_round(eng, prompts, args.new_tokens, args.temperature)
    base, ad = rounds["none"], rounds["adaptive"]
    print(f"preset {args.preset}, batch {args.batch}, {args.prompt_tokens}+{args.new_tokens} tokens, "
          f"chunk {args.chunk}, T={args.temperature}; per step: ops / Python calls, baseline then adaptive (AR)")  # fmt: skip
    for i in range(max(len(base), len(ad))):
        b = base[i] if i < len(base) else None
        a = ad[i] if i < len(ad) else None
        left = f"{b['ops']:6d} {b['calls']:7d}" if b else " " * 14
        right = f"{a['ops']:6d} {a['calls']:7d}" if a else ""
        kind = (a or b or {}).get("kind", "")
        if i < 6 or i >= max(len(base), len(ad)) - 3 or (a and b and (a["ops"] != b["ops"])):
            print(f"  step {i:3d} {kind:9s} {left} | {right}")
    for kind in ("filling", "steady", "shrinking"):
        tb = [s for s in base if s["kind"] == kind]
        ta = [s for s in ad if s["kind"] == kind]
        print(f"{kind:9s}: steps {len(tb)} / {len(ta)}; ops {sum(s['ops'] for s in tb)} / {sum(s['ops'] for s in ta)};"
              f" calls {sum(s['calls'] for s in tb)} / {sum(s['calls'] for s in ta)}")  # fmt: skip
    for kind in ("filling", "steady", "shrinking"):
        calls: Counter[str] = Counter()
        for s in ad:
            if s["kind"] == kind:
                calls.update(s["by_fn"])
        for s in base:
            if s["kind"] == kind:
                calls.subtract(s["by_fn"])
        top = [(k, v) for k, v in calls.most_common() if v > 0][:12]
        print(f"{kind}: Python calls the adaptive round made beyond the baseline's, by function:",
              ", ".join(f"{k} {v:+d}" for k, v in top) or "none")  # fmt: skip
    extra: Counter[str] = Counter()
    for s in ad:
        extra.update(s["by_op"])
    for s in base:
        extra.subtract(s["by_op"])
    print("ops the adaptive round issued beyond the baseline's:",
          ", ".join(f"{k} {v:+d}" for k, v in extra.most_common() if v) or "none")  # fmt: skip


if __name__ == "__main__":
    main()
