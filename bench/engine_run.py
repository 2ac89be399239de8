"""One timed batch through ``LLMEngine``, driven step by step to collect per-step timings.

``generate()`` would hide the step loop; here each ``step()`` is timed on the host clock, and the
engine's ``last_timings`` (draft / verify / rollback of the last speculative step; replaced by a
new object on every speculative step) are summed.

The device is synchronised before the first request and after the last step, not after every
step: a serving loop does not wait for a step's trailing device work (a speculative step's
rollback and advance, a prefill's MTP catch-up, the zeroing of finished requests' KV blocks)
before it plans the next step, and an engine reads what it needs (the sampled or accepted
tokens) where it needs it. So a step's time on the host clock may include device work queued by
the step before it; the run's wall time includes all of it. Until session 25 the benchmark
synchronised after every step, which kept that trailing work from overlapping the next step's
host work.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from engine import LLMEngine, SamplingParams
from engine.spec.adaptive import budget_label

_ids = itertools.count()


@dataclass
class BatchRun:
    """What one batch produced and how long it took."""

    wall_s: float  # add_request of the first prompt to the last token, prefill included
    tokens: list[list[int]]  # generated ids per prompt, in prompt order
    ttft_s: list[float]  # per prompt: first generated token
    tpot_s: list[float]  # per prompt: (finish - first token) / (tokens - 1)
    decode_steps: int = 0  # steps that ran a decode forward (autoregressive or verify)
    decode_s: float = 0.0  # wall time of those steps
    spec_steps: int = 0  # steps that speculated
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    num_steps: int = 0  # summed over requests (SpecStats)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps_per_arm: dict[str, int] = field(default_factory=dict)  # adaptive: decode steps per budget
    # Adaptive: its measured arm costs in this batch's bucket after the run (the engine's
    # ``acceptance_snapshot()["arm_costs"]``: what it chose by).
    arm_costs: list[dict[str, object]] = field(default_factory=list)
    # Adaptive: its measured filling steps (engine steps that prefilled and decoded) at decode
    # batches up to this batch's bucket (``acceptance_snapshot()["fill_costs"]``).
    fill_costs: list[dict[str, object]] = field(default_factory=list)
    # Adaptive: the fill questions asked during the run (does the batch being filled draft once
    # full? ``MeasuredArms.fill_questions``), with the terms weighed.
    fill_questions: list[dict[str, object]] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_batch(eng: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> BatchRun:
    """Generate for ``prompts`` together (one engine batch) and time every step. As in
    ``LLMEngine.generate``, the engine is told that nothing joins the batch."""
    with eng.closed_batch():
        return _run_batch(eng, prompts, sampling)


def _run_batch(eng: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> BatchRun:
    ids = [f"bench-{next(_ids)}" for _ in prompts]
    order = {rid: i for i, rid in enumerate(ids)}
    first: dict[str, float] = {}
    final: dict[str, object] = {}
    run = BatchRun(0.0, [[] for _ in prompts], [0.0] * len(prompts), [0.0] * len(prompts))
    arms_before = Counter(eng.adaptive.steps_per_arm) if eng.adaptive is not None else Counter()
    asked_before = eng.adaptive.arms.fill_questions_asked if eng.adaptive is not None else 0
    gc.collect()  # the previous run's garbage is not this run's to collect
    synchronize(eng.device)
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        eng.add_request(rid, list(prompt), sampling)
    while len(final) < len(ids):
        before = eng.last_timings
        s0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        if any(o.step_drafted is not None for o in outs):
            run.decode_steps += 1
            run.decode_s += now - s0
        timings = eng.last_timings
        if timings is not before:  # a speculative step ran
            run.spec_steps += 1
            run.draft_s += timings.draft
            run.verify_s += timings.verify
            run.rollback_s += timings.rollback
        for out in outs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                i = order[out.request_id]
                final[out.request_id] = out
                run.tokens[i] = list(out.token_ids)
                run.ttft_s[i] = first[out.request_id] - t0
                n = len(out.token_ids)
                run.tpot_s[i] = (now - first[out.request_id]) / (n - 1) if n > 1 else 0.0
                _add_stats(run, out.stats)
    synchronize(eng.device)  # the last step's trailing device work belongs to the run
    run.wall_s = time.perf_counter() - t0
    if eng.adaptive is not None:
        ran = eng.adaptive.steps_per_arm - arms_before
        run.steps_per_arm = {budget_label(budget): n for budget, n in ran.items()}
        bucket = len(prompts).bit_length()
        snapshot = eng.acceptance_snapshot()
        costs = snapshot.get("arm_costs", [])
        run.arm_costs = [c for c in costs  # type: ignore[attr-defined]
                         if max(round(c["batch_size"]), 1).bit_length() == bucket]  # fmt: skip
        fills = snapshot.get("fill_costs", [])
        run.fill_costs = [c for c in fills  # type: ignore[attr-defined]
                          if max(round(c["batch_size"]), 1).bit_length() <= bucket]  # fmt: skip
        questions = eng.adaptive.arms.fill_questions
        new = max(0, min(eng.adaptive.arms.fill_questions_asked - asked_before, len(questions)))
        run.fill_questions = [q.to_dict(budget_label) for q in list(questions)[len(questions) - new:]]
    return run


def _add_stats(run: BatchRun, stats: object) -> None:
    run.num_steps += stats.num_steps  # type: ignore[attr-defined]
    run.num_draft_tokens += stats.num_draft_tokens  # type: ignore[attr-defined]
    run.num_accepted_tokens += stats.num_accepted_tokens  # type: ignore[attr-defined]
    per = list(stats.accepted_per_position)  # type: ignore[attr-defined]
    if len(run.accepted_per_position) < len(per):
        run.accepted_per_position += [0] * (len(per) - len(run.accepted_per_position))
    for d, count in enumerate(per):
        run.accepted_per_position[d] += count
