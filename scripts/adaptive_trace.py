"""Step-by-step trace of adaptive speculation against the autoregressive baseline (a diagnosis
tool; the benchmark gives the figures).

For each temperature and batch size, as ``mtpserve bench offline`` orders them: a warm-up round,
then rounds that alternate the autoregressive engine and the adaptive one on the same prompts.
Prints each round's speedup and, per adaptive decode step, the budget it ran (a step launched
ahead is read whatever was chosen when it is), the batch, the rows the MTP modules were behind
and the step's milliseconds (``L``: behind; ``F``: it also prefilled; steps are timed as served,
without a synchronisation: with overlap on, a step's time is its turn, not its device work);
then the baseline's steps of the same round (batch:ms, ``F`` as above), to compare step by step.
``--method tree`` or ``chain`` traces a fixed budget's engine instead of the adaptive one. A step that only
prefills shows as ``P<n>:ms`` (``+cu<k>``: the MTP modules were caught up over k prompts in it).
A step during which a garbage collection ran, a Triton kernel variant was built or loaded, or the
CUDA allocator allocated device memory carries it in brackets (``bench.stall_probe``), e.g.
``P64+cu64:95.0[triton 3/80.1ms]``. A step whose prefill asked whether the batch being filled
drafts once full (and so catches its prompts up in their prefill) carries the answer and the terms
weighed, ``?chain-4[chain-4 22.6/(4.1+3.0)x1.50]``: the seconds saved over the horizon against
the catch-up and the drain, times the margin (in ms; ``?none`` alone: nothing was weighed).
With ``--cprofile-batch B`` the adaptive engine's last round at batch B runs under cProfile and
the host functions taking the most time follow its trace.

    PYTHONPATH=. python scripts/adaptive_trace.py [--model models/demo] [--device cuda]
        [--batch-sizes 1,64,256] [--temperatures 0,0.7] [--rounds 3] [--max-new-tokens 64]
        [--cprofile-batch 256] [--spin-ms 50]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from bench.contenders import load_base
from bench.engine_run import run_batch
from bench.gpu_clock import spin
from bench.prompts import load_prompts
from bench.stall_probe import StallProbe, describe
from engine import LLMEngine, SamplingParams, SpecConfig
from engine.gc_tuning import settle_heap
from engine.spec.adaptive import budget_label


def _traced(eng: LLMEngine, trace: list[str], probe: StallProbe) -> None:
    """Wrap ``eng.step`` to append one entry per decode step: budget:batch:lag:ms."""
    choose, step = eng.batch_choice.choose, eng.step
    last: list[tuple[str, int, int, bool]] = []

    def choose_traced(seqs, filling=False, closed=False):  # type: ignore[no-untyped-def]
        budget, lag, sampled = choose(seqs, filling, closed)
        last.append((budget_label(budget), len(seqs), lag, filling))
        return budget, lag, sampled

    caught_up: list[int] = []
    drafter = eng.drafter
    if drafter is not None:
        catch_up = drafter.catch_up

        def catch_up_traced(seqs):  # type: ignore[no-untyped-def]
            caught_up.append(len(seqs))
            return catch_up(seqs)

        drafter.catch_up = catch_up_traced  # type: ignore[method-assign]

    # The fill's question (does the batch being filled draft once full?): its answer and the
    # terms weighed, ``?arm[save/(cu+drain)*margin ms]``, or ``?none`` when nothing was weighed.
    asked: list[str] = []
    filled_drafts = eng.batch_choice.filled_batch_drafts

    def filled_drafts_traced():  # type: ignore[no-untyped-def]
        arms = eng.adaptive.arms if eng.adaptive is not None else None
        if arms is not None:
            arms.last_weighing = None
        answer = filled_drafts()
        w = arms.last_weighing if arms is not None else None
        terms = "" if w is None else (
            f"[{budget_label(w.arm)} {w.saving * 1e3:.1f}/({w.catch_up * 1e3:.1f}+{w.drain * 1e3:.1f})"
            f"x{w.margin:.2f}]"
        )
        asked.append(f"?{'none' if answer is None else budget_label(answer)}{terms}")
        return answer

    eng.batch_choice.filled_batch_drafts = filled_drafts_traced  # type: ignore[method-assign]

    def step_traced():  # type: ignore[no-untyped-def]
        last.clear()
        caught_up.clear()
        asked.clear()
        before = probe.snapshot()
        start = time.perf_counter()
        outs = step()  # no synchronisation: with overlap a step's device work runs under the next's host work
        ms = (time.perf_counter() - start) * 1e3
        stalls = _stalls(probe, before) + "".join(asked)
        if last:
            # The budget the step ran: a step launched ahead is read whatever was chosen then.
            chosen, batch, lag, filling = last[0]
            label = eng.last_decode_budget or chosen
            # ``F``: the step also prefilled (``+cu<k>``: and caught k prompts up in it).
            fill = f"F{f'+cu{sum(caught_up)}' if caught_up else ''}" if filling else ""
            trace.append(f"{label}{'L' if lag else ''}{fill}:{batch}:{ms:.1f}{stalls}")
        elif outs:  # a prefill alone: its first tokens (and a catch-up over its prompts, if any)
            trace.append(f"P{len(outs)}{f'+cu{sum(caught_up)}' if caught_up else ''}:{ms:.1f}{stalls}")
        return outs

    eng.batch_choice.choose = choose_traced  # type: ignore[method-assign]
    eng.step = step_traced  # type: ignore[method-assign]


def _stalls(probe: StallProbe, before: dict[str, object]) -> str:
    text = describe(probe.since(before))
    return f"[{text}]" if text else ""


def _timed(eng: LLMEngine, trace: list[str], probe: StallProbe) -> None:
    """Wrap ``eng.step`` to append batch:ms per step that decoded."""
    step = eng.step

    def step_timed():  # type: ignore[no-untyped-def]
        before = probe.snapshot()
        start = time.perf_counter()
        outs = step()
        decoded = [o for o in outs if o.step_drafted is not None]
        ms = (time.perf_counter() - start) * 1e3
        stalls = _stalls(probe, before)
        if decoded:
            fill = "F" if len(decoded) < len(outs) else ""  # it also prefilled (first tokens out)
            trace.append(f"{fill}{len(decoded)}:{ms:.1f}{stalls}")
        elif outs:  # a prefill alone
            trace.append(f"P{len(outs)}:{ms:.1f}{stalls}")
        return outs

    eng.step = step_timed  # type: ignore[method-assign]


def _arm_state(eng: LLMEngine, batch: int, sampled: bool, prompt_rows: int) -> str:
    """What the adaptive choice knows at ``batch``'s bucket after its rounds: each arm's step
    ms (served steps; the start-up calibration's ms), the yield it counts on, and the catch-up
    cost of the batch's prompts (``prompt_rows`` rows each)."""
    assert eng.adaptive is not None
    arms = eng.adaptive.arms
    parts = []
    for arm, cost in arms.bucket_costs(batch, sampled).items():
        cal = "-" if cost.calibrated is None else f"{cost.calibrated * 1e3:.2f}"
        parts.append(f"{budget_label(arm)} {cost.seconds * 1e3:.2f}ms (served {cost.served}, cal {cal}, "
                     f"yield {arms.tokens_per_seq(sampled, arm, cost):.2f})")
    rows = batch * prompt_rows
    parts.append(f"catch-up of {rows} rows {arms.catch_up_seconds(rows) * 1e3:.1f}ms, "
                 f"its rows alone {arms.catch_up.row_seconds(rows) * 1e3:.1f}ms")
    return "state: " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--cprofile-batch", type=int, default=None)
    parser.add_argument("--method", default="adaptive", choices=["adaptive", "tree", "chain"],
                        help="the speculating engine traced (default adaptive)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="prompt tokens prefilled per step by both engines (default: the engine's)")
    parser.add_argument("--spin-ms", type=float, default=50.0,
                        help="ms of GPU matrix products before every run, as the benchmark's "
                             "--spin-ms (without, a round's first prefill ran at the idle clock: "
                             "43-74 ms against ~10 in session 35's traces); 0: none")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    base = load_base(args.model, args.device, dtype, max(batches), args.prompt_tokens + args.max_new_tokens, None,
                     prefill_chunk_tokens=args.prefill_chunk_tokens)
    adaptive = LLMEngine(base.model, base.tokenizer, base.eos_token_ids, SpecConfig(method=args.method),
                         base.config, base.device)
    if adaptive.adaptive is not None:
        adaptive.use_acceptance_prior(args.model)  # as ``LLMEngine.from_pretrained`` does
    prompts, source = load_prompts(args.model, base.tokenizer, base.model_config.vocab_size, max(batches),
                                   args.prompt_tokens)
    print(f"model {args.model} on {args.device} ({dtype}), prompts {source}")
    trace: list[str] = []
    base_trace: list[str] = []
    probe = StallProbe(args.device).install()
    _traced(adaptive, trace, probe)
    _timed(base, base_trace, probe)
    settle_heap()  # as the benchmark and the server do
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for batch in batches:
            batch_prompts = prompts[:batch]
            for r in range(args.rounds + 1):
                tokens = 16 if r == 0 else args.max_new_tokens
                sp = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True)
                base_trace.clear()
                spin(base.device, args.spin_ms)
                ar = run_batch(base, batch_prompts, sp)
                trace.clear()
                spin(base.device, args.spin_ms)
                profiler = cProfile.Profile() if batch == args.cprofile_batch and r == args.rounds else None
                if profiler is not None:
                    profiler.enable()
                ad = run_batch(adaptive, batch_prompts, sp)
                if profiler is not None:
                    profiler.disable()
                speedup = (ad.output_tokens / ad.wall_s) / (ar.output_tokens / ar.wall_s)
                name = "warm-up" if r == 0 else f"round {r}"
                print(f"T={temperature} b={batch} {name}: speedup {speedup:.2f} "
                      f"(ar {ar.wall_s * 1e3:.1f} ms, adaptive {ad.wall_s * 1e3:.1f} ms)")
                print("    adaptive:", " ".join(trace))
                print("    ar:      ", " ".join(base_trace))
                if r == args.rounds and adaptive.adaptive is not None:
                    print("    " + _arm_state(adaptive, batch, temperature > 0, args.prompt_tokens))
                if profiler is not None:  # (its own overhead inflates the round above)
                    print("    host profile of that adaptive round (top 30 by own time):")
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
