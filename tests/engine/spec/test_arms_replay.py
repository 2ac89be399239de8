"""A replay of the H200 benchmark's sweep through the measured choice (engine/spec/arms.py).

Static batches of 1 to 256 prompts decode 64 tokens each (a 16-token warm-up round first), as
``mtpserve bench offline`` runs them, against step costs shaped after the H200's with the
``gpu`` preset (graphed steps, host work included; ``bench/results/h200-2026-12-01-catch-up.json``
and the traces of that day). Each sequence accepts its own share of the tree's or the chain's
yield, so a drafting batch drains over its last steps, as on the H200. Greedy decoding and a
sampled one (whose autoregressive steps cost 35% more: the sampling kernels) are replayed on
five seeds of noise. Adaptive speculation must draft where drafting wins and stay within 5% of
autoregressive decoding where it loses. (The choice before the switching rules of 2026-12-01,
commit 4d06fcd, falls to 0.94x at batch 16 greedy here; on the H200 it fell to 0.70x at 64 and
256, on noise this replay does not draw: ``test_arms.py`` holds that case.)
"""

from __future__ import annotations

import random
import statistics
import sys
from collections import Counter

import pytest

from engine.spec.arms import MeasuredArms
from engine.spec.drafter import TreeBudget

NO_SPEC = TreeBudget(topk=1, depth=0, num_draft_tokens=0)
CHAIN = TreeBudget(topk=1, depth=4, num_draft_tokens=4)
TREE = TreeBudget(topk=4, depth=6, num_draft_tokens=32)
ARMS = [NO_SPEC, TREE, CHAIN]
STEP_MS = {  # (batch, ms per step)
    NO_SPEC: [(1, 1.18), (4, 1.22), (16, 1.35), (64, 1.75), (256, 3.1)],
    TREE: [(1, 2.2), (4, 2.45), (16, 3.2), (64, 6.8), (256, 20.4)],
    CHAIN: [(1, 1.7), (4, 1.9), (16, 2.5), (64, 5.3), (256, 14.0)],
}
YIELD = {TREE: 4.7, CHAIN: 3.3}  # tokens per sequence per step, on average
CALIBRATION = [(64, 0.013), (1024, 0.031), (4096, 0.046)]  # catch-ups timed at start-up


def _step_seconds(arm: TreeBudget, batch: int, ar_factor: float) -> float:
    points = STEP_MS[arm]
    ms = points[-1][1]
    for (b0, s0), (b1, s1) in zip(points, points[1:], strict=False):
        if batch <= b1:
            ms = s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
            break
    return ms * 1e-3 * (ar_factor if arm == NO_SPEC else 1.0)


def _round(arms: MeasuredArms, rng: random.Random, batch: int, tokens: int, ar_factor: float) -> float:
    """One static batch decoded to ``tokens`` each: seconds, catch-ups included. Finished
    sequences report their relative yields and the batch is closed, as the engine runs it, so
    drafting is charged for its drain from the spread once it is known."""
    lag = batch * 55  # the prompts' rows beyond a steady step's slack
    done = [0] * batch
    share = [rng.uniform(0.55, 1.45) for _ in range(batch)]  # how well each prompt is drafted
    # Per sequence: drafting steps, their tokens, the arms' mean yields summed over them.
    drafted = [[0, 0.0, 0.0] for _ in range(batch)]
    seconds = 0.0
    while min(done) < tokens:
        alive = [i for i in range(batch) if done[i] < tokens]
        left = sum(tokens - done[i] for i in alive) / len(alive)
        arm = arms.choose(len(alive), False, ARMS, lag, left, closed=True)
        step = _step_seconds(arm, len(alive), ar_factor) * rng.uniform(0.95, 1.1)
        produced = chain_would = 0
        mean = arms.mean_yield(False, arm)
        for i in alive:
            n = 1 if not arm.speculates else max(1, round(YIELD[arm] * share[i] + rng.uniform(-1, 1)))
            # What the chain would have accepted on the same prompt (the engine reads it off a
            # tree step's path: its leading rank-0 nodes).
            chain_would += max(1, min(n, round(YIELD[CHAIN] * share[i] + rng.uniform(-1, 1))))
            n = min(n, tokens - done[i])
            done[i] += n
            produced += n
            steps, made, expected = drafted[i]
            if done[i] == tokens:  # its last step is cut short: left out
                arms.observe_finished(made, expected, steps)
            elif arm.speculates:
                drafted[i] = [steps + 1, made + n, expected + mean]
        if arm.speculates and lag:
            catch_up = 0.012 + 7e-6 * lag
            arms.observe_catch_up(len(alive), False, arm, catch_up, lag, timed_alone=True)
            seconds += catch_up
            lag = 0
        elif not arm.speculates:
            lag += len(alive)
        arms.observe(len(alive), False, arm, step, produced)
        if arm == TREE:
            arms.observe_counterfactual_yield(len(alive), False, CHAIN, chain_would)
        seconds += step
    return seconds


def test_batch_one_keeps_the_tree_when_it_wins_on_every_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch 1 every round is a new prompt, and prompts differ by more than the arms do: a
    chain explored on an easy prompt once outranked the tree measured on a hard one for a whole
    request (with the H200's session-13 costs below, the tree at 0.34 ms per token and the chain
    at 0.49, this replay gave the chain ~10% of the steps). Tree steps also tell what the chain
    would have yielded on the same prompt, so the chain is only re-run for its step cost."""
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "STEP_MS", {NO_SPEC: [(1, 1.19)], TREE: [(1, 1.64)], CHAIN: [(1, 1.48)]})
    monkeypatch.setattr(this, "YIELD", {TREE: 4.78, CHAIN: 3.03})
    chosen: Counter[TreeBudget] = Counter()
    for seed in range(20):
        rng = random.Random(seed)
        arms = MeasuredArms()
        arms.catch_up.calibrate(CALIBRATION)
        choose = arms.choose
        monkeypatch.setattr(arms, "choose", lambda *a, choose=choose, **k: _count(chosen, choose(*a, **k)))
        for r in range(6):  # a 16-token warm-up round, then five of 64
            _round(arms, rng, 1, 16 if r == 0 else 64, 1.0)
    total = sum(chosen.values())
    assert chosen[TREE] > 0.9 * total and chosen[CHAIN] < 0.06 * total, chosen


def _count(chosen: Counter[TreeBudget], arm: TreeBudget) -> TreeBudget:
    chosen[arm] += 1
    return arm


def _sweep(ar_factor: float, seeds: int = 5) -> dict[int, float]:
    """Median over seeds of each batch's median speedup over 3 timed rounds."""
    speedups: dict[int, list[float]] = {}
    for seed in range(seeds):
        rng = random.Random(seed)
        arms = MeasuredArms()
        arms.catch_up.calibrate(CALIBRATION)
        for batch in (1, 4, 16, 64, 256):
            rounds = []
            for r in range(4):
                tokens = 16 if r == 0 else 64
                seconds = _round(arms, rng, batch, tokens, ar_factor)
                if r:
                    rounds.append(tokens * _step_seconds(NO_SPEC, batch, ar_factor) / seconds)
            speedups.setdefault(batch, []).append(statistics.median(rounds))
    return {b: statistics.median(v) for b, v in speedups.items()}


@pytest.mark.parametrize(
    ("ar_factor", "floors"),
    [
        (1.0, {1: 1.4, 4: 1.08, 16: 0.95, 64: 0.95, 256: 0.95}),  # greedy
        (1.35, {1: 1.9, 4: 1.4, 16: 1.1, 64: 0.95, 256: 0.95}),  # sampled
    ],
    ids=["greedy", "sampled"],
)
def test_the_benchmark_sweep_drafts_where_it_wins_and_stays_near_autoregressive_elsewhere(
    ar_factor: float, floors: dict[int, float]
) -> None:
    speedups = _sweep(ar_factor)
    assert all(speedups[b] >= floor for b, floor in floors.items()), speedups
