"""Start-up calibration of the graphed path's arms: every captured decode step timed at every
batch bucket, before the first request.

Adaptive speculation chooses per step among the captured budgets ("arms": no speculation, a
chain, the tree) by their cost per emitted token (``engine.spec.arms``). A step's cost is a
CUDA-graph replay plus host work, which hardly varies with what is decoded; so it is measured
here once, on the engine's own decode path, for each arm at each batch size the graphs were
captured for (1, 2, 4, ... up to the batch limit and what the KV pool holds): the latency model
of the verify step as a function of its total tokens (batch x tree nodes). Without it each arm's
cost at each batch size was learnt online, by exploring runs that each paid an MTP catch-up
(at batch 256: 31 of 298 steps, several catch-ups of 256 prompts, what kept adaptive
speculation below autoregressive decoding there).

How: scratch requests (random prompts, EOS ignored) are admitted as one batch, prefilled, and
decoded a few steps with each arm forced (``AdaptiveController.forced``); the median of the
steady steps is the arm's step time (the first steps of an arm catch the MTP modules up, or
capture a graph variant, and are not timed). The steps run back to back, each timed from the
end of the one before, as served steps run: with ``EngineConfig.overlap_steps`` a step's host
work overlaps the next step's device work, and a step is what its turn costs, not its device
and host work one after the other. (Timed one at a time, with the device idle before and after
each, the H200's autoregressive step at batch 256 was calibrated at 2.8 ms where the
baseline's served steps took 2.1 ms without overlap and 1.8 ms with it, and adaptive
speculation drafted at batch 256 where it lost 3-6%: session 27.) Greedy and sampled steps are
timed separately (the sampled tree runs its own graphs). The engine is left as it was: the
requests aborted (their blocks zeroed), the acceptance counters and adaptive state reset. Only
step times are kept: what random prompts yield says nothing of real ones. An arm's yield is
learnt by running it (``MeasuredArms.choose`` runs each drafting arm once early, where its
catch-up fits the requests' horizon) and predicted from the live acceptance statistics.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.params import SamplingParams
from engine.spec.drafter import TreeBudget

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

# Tokens per scratch prompt: the context the steps are timed at. A step's attention reads every
# committed entry, so its cost grows with the context, a drafting step's most (its tree's tokens
# and MTP rows each read it): on the H200 (gpu preset, batch 256) chain-4 steps cost 3.37 ms at 8
# tokens, 3.87 at 64, 4.68 at 160 and 6.67 at 400, autoregressive ones 1.67 / 1.82 / 2.08 / 2.55
# (``bench/results/h200-2026-12-02-session19-profile.json``). Timed at 8, drafting at batch 256
# looked 1.6 times cheaper than the steps served on 64-token prompts ran, and the engine paid a
# catch-up of 256 prompts to draft where it could not win. The steps served refine the times.
# 122 + the autoregressive arm's second pass (6 tokens, below) keeps the scratch requests at the
# blocks the 128 of one pass took, so the H200's pool still holds batch 256's.
PROMPT_TOKENS = 122
WARM_STEPS = 2  # per arm before timing: a catch-up after the previous arm, a graph variant
TIMED_STEPS = 4  # per arm: the median is its step time
# The autoregressive step is timed first and again after the drafting arms; it keeps the faster
# pass's median. Its time calibrated too high is not corrected while drafting wins on it (a run
# of autoregressive steps is rare there: it leaves a catch-up behind), one too low is as soon as
# it runs: the H200's step at batch 256, timed once right after the scratch batch's fill, was
# calibrated at 1.77 ms where served ones took 0.9, and the engine drafted at batch 256 in every
# round of the sweep, at 0.90x (session 31). (Two passes over every arm no longer fit batch 256's
# scratch requests in the pool.)
NO_SPEC_PASSES = 2


@dataclass(frozen=True)
class ArmTiming:
    """One arm's decode step at one batch size, as calibrated."""

    batch_size: int
    sampled: bool
    arm: TreeBudget
    seconds: float  # median steady step, host work included

    @property
    def verify_tokens(self) -> int:
        """Tokens the step's target forward verifies: the batch times the tree's nodes."""
        return self.batch_size * (self.arm.num_draft_tokens + 1)


def scratch_max_tokens(engine: LLMEngine, arms: list[TreeBudget], batch: int, prompt_tokens: int) -> int:
    """Tokens a scratch request may emit: every arm's steps at its deepest path, plus one per
    step of the batch's prefill (a prompt prefilled in an early chunk decodes, one token a step,
    while the later ones are prefilled: 256 prompts of 128 tokens take 8 steps of 4096), plus
    slack."""
    timed = sum((WARM_STEPS + TIMED_STEPS) * (arm.depth + 1) for arm in arms)
    timed += (NO_SPEC_PASSES - 1) * (WARM_STEPS + TIMED_STEPS)  # the autoregressive arm again
    prefill_steps = -(-batch * prompt_tokens // engine.scheduler.prefill_chunk_tokens)
    return timed + prefill_steps + 8


def calibration_batch_sizes(
    engine: LLMEngine, arms: list[TreeBudget], prompt_tokens: int = PROMPT_TOKENS
) -> list[int]:
    """Powers of two up to the batch limit whose scratch requests the KV pool holds."""
    sizes, b = [], 1
    while b <= engine.config.max_batch_size:
        per_request = engine.scheduler.blocks_for(prompt_tokens + scratch_max_tokens(engine, arms, b, prompt_tokens))
        if b * per_request > engine.pool.num_free:
            break
        sizes.append(b)
        b *= 2
    return sizes


@torch.inference_mode()
def calibrate_arms(
    engine: LLMEngine, no_spec: TreeBudget, seed: int = 0, prompt_tokens: int = PROMPT_TOKENS,
    kinds: tuple[bool, ...] = (False, True),
) -> list[ArmTiming]:
    """Time every captured arm and ``no_spec`` (the autoregressive step) at every calibration
    batch size, for each kind of step in ``kinds`` (greedy: False, sampled: True), over scratch
    prompts of ``prompt_tokens``; leaves the engine as it found it. Empty without an adaptive
    controller or captured arms."""
    if engine.adaptive is None:
        return []
    gen = torch.Generator().manual_seed(seed)
    timings: list[ArmTiming] = []
    for sampled in kinds:
        arms = engine.graphed_budgets(sampled)
        if not arms:
            continue
        arms = [no_spec, *arms]
        # A short context limit shortens the prompts (a model that short serves short contexts).
        longest = engine.config.max_batch_size
        prompt = min(prompt_tokens, engine.max_model_len - scratch_max_tokens(engine, arms, longest, prompt_tokens))
        if prompt < 1:
            continue  # a context too short for the scratch requests: learnt online instead
        for batch in calibration_batch_sizes(engine, arms, prompt):
            # Unseeded: a seeded sampled request takes the host-driven path, not the graphed step.
            params = SamplingParams(max_tokens=scratch_max_tokens(engine, arms, batch, prompt), ignore_eos=True,
                                    temperature=1.0 if sampled else 0.0)  # fmt: skip
            timings += _time_batch(engine, arms, batch, sampled, params, gen, prompt)
    _reset(engine)
    return timings


def _time_batch(
    engine: LLMEngine, arms: list[TreeBudget], batch: int, sampled: bool, params: SamplingParams,
    gen: torch.Generator, prompt_tokens: int = PROMPT_TOKENS,
) -> list[ArmTiming]:
    adaptive = engine.adaptive
    assert adaptive is not None
    vocab = engine.model_config.vocab_size
    ids = [f"arm-calibration-{int(sampled)}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist(), params)
    best: dict[TreeBudget, float] = {}
    try:
        adaptive.forced = arms[0]
        while engine.num_waiting or any(_in_prefill(engine, rid) for rid in ids):
            engine.step()
        for arm in [*arms, *[arms[0]] * (NO_SPEC_PASSES - 1)]:
            adaptive.forced = arm
            engine.wait_for_device()
            ends = [time.perf_counter()]
            for _ in range(WARM_STEPS + TIMED_STEPS):
                engine.step()  # a decode step ends on a read of its results
                ends.append(time.perf_counter())
            if engine.num_running != batch:
                raise RuntimeError(f"arm calibration: the batch of {batch} shrank while timing")
            steps = [b - a for a, b in zip(ends[WARM_STEPS:], ends[WARM_STEPS + 1:], strict=False)]
            best[arm] = min(best.get(arm, float("inf")), statistics.median(steps))
    finally:
        adaptive.forced = None
        for rid in ids:
            engine.abort_request(rid)
    return [ArmTiming(batch, sampled, arm, best[arm]) for arm in arms]


def _in_prefill(engine: LLMEngine, request_id: str) -> bool:
    seq = engine.sequence(request_id)
    if seq is None:
        raise RuntimeError(f"arm calibration: scratch request {request_id} ended in its prefill")
    return seq.in_prefill


def _reset(engine: LLMEngine) -> None:
    """Forget what the scratch requests left in the engine's statistics."""
    adaptive = engine.adaptive
    assert adaptive is not None
    adaptive.reset_measurements()
    engine.reset_statistics()
