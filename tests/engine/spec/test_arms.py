"""engine/spec/arms.py: the graphed path's measured choice among captured draft budgets."""

from __future__ import annotations

import pytest

from engine.spec.arm_measurements import StepCost
from engine.spec.arms import MeasuredArms
from engine.spec.drafter import TreeBudget

NO_SPEC = TreeBudget(topk=1, depth=0, num_draft_tokens=0)
CHAIN = TreeBudget(topk=1, depth=4, num_draft_tokens=4)
TREE = TreeBudget(topk=4, depth=6, num_draft_tokens=32)
ARMS = [NO_SPEC, CHAIN, TREE]


def _best(arms: MeasuredArms, bucket: int) -> TreeBudget:
    """The cheapest arm per token in ``bucket``; every arm must be measured there."""
    costs = {arm: arms.per_token(bucket, False, arm) for arm in ARMS}
    assert all(c is not None for c in costs.values()), costs
    return min(ARMS, key=lambda arm: costs[arm])  # type: ignore[arg-type, return-value]


def _drive(
    arms: MeasuredArms, batch: int, costs: dict[TreeBudget, tuple[float, int]], steps: int
) -> list[TreeBudget]:
    """``steps`` decode steps as the engine runs them: each arm costs (seconds, tokens); a
    speculative step right after an AR step catches the MTP modules up and is not observed."""
    chosen: list[TreeBudget] = []
    for _ in range(steps):
        arm = arms.choose(batch, False, ARMS)
        if not (arm.speculates and chosen and not chosen[-1].speculates):
            arms.observe(batch, False, arm, *costs[arm])
        chosen.append(arm)
    return chosen


def test_the_cheapest_arm_per_token_carries_the_steps_and_the_others_are_rechecked() -> None:
    arms = MeasuredArms()
    # Per token: AR 2.5 ms, chain 1.25 ms, tree 1.0 ms at batch 4.
    costs = {NO_SPEC: (0.010, 4), CHAIN: (0.015, 12), TREE: (0.020, 20)}
    chosen = _drive(arms, 4, costs, 400)
    assert _best(arms, 3) == TREE
    tail = chosen[60:]
    assert tail.count(TREE) >= 0.85 * len(tail)
    assert NO_SPEC in tail and CHAIN in tail, "the other arms are re-run now and then"


def test_autoregressive_wins_where_every_draft_costs_more_than_it_yields() -> None:
    arms = MeasuredArms()
    costs = {NO_SPEC: (0.010, 64), CHAIN: (0.030, 128), TREE: (0.060, 200)}
    chosen = _drive(arms, 64, costs, 400)
    assert _best(arms, 7) == NO_SPEC
    assert chosen[60:].count(NO_SPEC) >= 0.85 * len(chosen[60:])


def test_a_new_bucket_starts_from_the_nearest_measured_one_without_a_full_round() -> None:
    """A batch entering a bucket not measured yet (the batch grows or shrinks) uses the best arm
    of the nearest measured bucket and measures its own at the exploration cadence only."""
    arms = MeasuredArms(explore_every=16)
    _drive(arms, 16, {NO_SPEC: (0.01, 16), CHAIN: (0.012, 48), TREE: (0.02, 64)}, 100)
    assert _best(arms, 5) == CHAIN
    first = [arms.choose(24, False, ARMS) for _ in range(10)]  # bucket 5 too: measured
    assert first.count(CHAIN) >= 7, first
    nxt = [arms.choose(40, False, ARMS) for _ in range(10)]  # bucket 6: nothing measured
    assert nxt.count(CHAIN) >= 7, nxt


def test_a_buckets_few_unlucky_steps_do_not_decide_the_pooled_yield_does() -> None:
    """Three sampled steps of one token per sequence at batch 4 must not decide: the yield of
    that arm measured over many steps elsewhere stands in; step times stay per bucket."""
    arms = MeasuredArms()
    for _ in range(60):  # batch 1: the tree yields 5 tokens per step
        arms.observe(1, True, TREE, 0.010, 5)
        arms.observe(1, True, NO_SPEC, 0.008, 1)
    for _ in range(3):  # batch 4: unlucky steps, 1 token per sequence
        arms.observe(4, True, TREE, 0.012, 4)
        arms.observe(4, True, NO_SPEC, 0.009, 4)
    tree, ar = arms.per_token(3, True, TREE), arms.per_token(3, True, NO_SPEC)
    assert tree is not None and ar is not None
    assert tree < ar  # 0.012 / (4 x ~4.9) < 0.009 / 4


def test_a_stalled_step_counts_at_most_twice_the_fastest() -> None:
    cost = StepCost(0.01, 4.0, 4.0, 1, 0.01)
    cost.add(1.0, 4, 4)  # a graph upload or a garbage collection
    assert cost.seconds <= 0.02


def _h200_like(arm: TreeBudget, batch: int) -> tuple[float, float]:
    """(seconds per step, tokens per sequence): launch-bound at small batches, drafting's verify
    work growing with the batch (shaped after the H200 figures of the gpu preset)."""
    if not arm.speculates:
        return (1.1 + 0.01 * batch) * 1e-3, 1.0
    if arm == CHAIN:
        return (1.6 + 0.05 * batch) * 1e-3, 3.4
    return (2.3 + 0.085 * batch) * 1e-3, 4.9


@pytest.mark.parametrize("order", [(1, 4, 16, 64, 256), (16, 1, 256, 4, 64)])
def test_a_batch_sweep_stays_within_a_few_percent_of_the_best_arm_at_every_size(order: tuple[int, ...]) -> None:
    """Batches growing from 1 to 256 as in the benchmark, or in another order (the benchmark's
    check batch first): speculation wins small batches and loses large ones. The MTP modules start a prompt behind and fall one row per sequence behind
    with every autoregressive step; a drafting step first catches them up (4 us per row, as
    measured and reported). Time per token stays within 8% of the best arm's at every batch
    size, exploration, catch-ups and the first measurements included."""
    arms = MeasuredArms()
    for batch in order:
        best = min(s / (batch * t) for s, t in (_h200_like(a, batch) for a in ARMS))
        seconds = tokens = 0.0
        lag = 64 * batch  # the prompts
        for i in range(300):
            arm = arms.choose(batch, False, ARMS, lag, tokens_left=300 - i)
            step, per_seq = _h200_like(arm, batch)
            if arm.speculates and lag:
                step += 4e-6 * lag
                arms.observe_catch_up(batch, False, arm, step, lag)
                lag = 0
            else:
                arms.observe(batch, False, arm, step, round(per_seq * batch))
                lag += 0 if arm.speculates else batch
            seconds += step
            tokens += per_seq * batch
        assert seconds / tokens <= 1.08 * best, (batch, seconds / tokens / best)


@pytest.mark.parametrize(("lag", "drafts"), [(64, True), (6400, False)])
def test_drafting_must_win_back_its_catch_up(lag: int, drafts: bool) -> None:
    """A drafting arm measured 20% cheaper per token than autoregressive decoding is taken only
    if catching the MTP modules up over the rows they are behind (measured per row) is won back
    within SWITCH_HORIZON steps; a much cheaper one wins back a long catch-up."""
    arms = MeasuredArms(explore_every=10_000)  # no exploration in this test
    for _ in range(3):
        arms.observe(64, False, NO_SPEC, 0.010, 64)  # 0.156 ms per token
        arms.observe(64, False, CHAIN, 0.026, 200)  # 0.130 ms per token
        arms.observe(64, False, TREE, 0.100, 256)  # 0.39 ms per token
    arms.observe_catch_up(64, False, CHAIN, 0.026 + 0.010, 640)  # 10 ms for 640 rows
    assert arms.choose(64, False, ARMS, lag) == (CHAIN if drafts else NO_SPEC)
    assert arms.choose(64, False, ARMS, 0) == CHAIN
    for _ in range(3):
        arms.observe(64, False, CHAIN, 0.005, 200)  # 0.025 ms per token: 6x cheaper
    assert arms.choose(64, False, ARMS, 3000) == CHAIN


@pytest.mark.parametrize(("tokens_left", "drafts"), [(16, False), (200, True)])
def test_the_catch_up_is_weighed_against_the_tokens_the_requests_have_left(
    tokens_left: int, drafts: bool
) -> None:
    """The same catch-up of 6400 rows (100 ms) against a chain saving 0.026 ms per token at
    batch 64: 16 tokens left per request save 27 ms (not worth it), 200 tokens save 333 ms."""
    arms = MeasuredArms(explore_every=10_000)
    for _ in range(3):
        arms.observe(64, False, NO_SPEC, 0.010, 64)  # 0.156 ms per token
        arms.observe(64, False, CHAIN, 0.026, 200)  # 0.130 ms per token
    arms.observe_catch_up(64, False, CHAIN, 0.026 + 0.010, 640)  # 10 ms for 640 rows
    chosen = arms.choose(64, False, [NO_SPEC, CHAIN], 6400, tokens_left=tokens_left)
    assert chosen == (CHAIN if drafts else NO_SPEC)


def test_a_bucket_the_batch_comes_back_to_does_not_find_every_arm_overdue() -> None:
    """Exploration waits count the bucket's own steps: a batch that passes through bucket 4
    (batch 8) on its way to 64, over and over, does not re-run the other arms there each time
    (every run catching up the MTP modules over hundreds of rows)."""
    arms = MeasuredArms()
    costs = {NO_SPEC: (0.010, 8), CHAIN: (0.020, 16), TREE: (0.040, 24)}  # AR is cheapest
    _drive(arms, 8, costs, 60)
    _drive(arms, 64, {NO_SPEC: (0.012, 64), CHAIN: (0.08, 128), TREE: (0.2, 192)}, 60)
    explored = 0
    for _ in range(5):  # five more passes: one step at batch 8, then 200 at batch 64
        explored += sum(a.speculates for a in _drive(arms, 8, costs, 1))
        _drive(arms, 64, {NO_SPEC: (0.012, 64), CHAIN: (0.08, 128), TREE: (0.2, 192)}, 200)
    assert explored <= 1


def test_an_arm_measured_only_at_a_larger_batch_is_measured_soon_at_a_small_one() -> None:
    """As in the benchmark: the check batch (16) runs first, where autoregressive decoding wins;
    at batch 1, behind by its prompt, the drafting arms (whose steps are cheaper there than at
    16) are still measured within ``explore_every`` steps, and the tree then carries the batch."""
    arms = MeasuredArms()
    _drive(arms, 16, {NO_SPEC: (0.018, 16), CHAIN: (0.06, 48), TREE: (0.15, 72)}, 100)
    arms.observe_catch_up(16, False, TREE, 0.15 + 0.1, 1024)  # 0.1 ms per row
    chosen = [arms.choose(1, False, ARMS, lag_rows=64, tokens_left=64) for _ in range(24)]
    assert any(a.speculates for a in chosen[:17]) and TREE in chosen, chosen
    for _ in range(5):
        arms.observe(1, False, TREE, 0.012, 5)
        arms.observe(1, False, NO_SPEC, 0.010, 1)
    assert [arms.choose(1, False, ARMS, tokens_left=64) for _ in range(10)].count(TREE) >= 8


def test_a_catch_up_stall_does_not_set_the_cost_of_catching_up() -> None:
    """The first steps of an arm carry one-off costs (kernels compiled, a graph's first replay):
    a catch-up of an arm measured nowhere yet says nothing; later, the lower median of recent
    catch-ups stands, so one stall cannot forbid drafting, nor one short timing make it free."""
    arms = MeasuredArms()
    arms.observe_catch_up(1, False, TREE, 0.5, 64)  # no steady tree step yet: ignored
    assert arms.catch_up_seconds(64) == 0.0
    for _ in range(3):
        arms.observe(1, False, TREE, 0.002, 5)
    arms.observe_catch_up(1, False, TREE, 0.002 + 0.004, 64)  # 4 ms for 64 rows
    assert arms.catch_up_seconds(64) == pytest.approx(0.004)
    arms.observe_catch_up(1, False, TREE, 0.5, 64, timed_alone=True)  # a stall
    assert arms.catch_up_seconds(64) == pytest.approx(0.004)
    arms.observe_catch_up(1, False, TREE, 0.0, 64, timed_alone=True)  # timed short
    arms.observe_catch_up(1, False, TREE, 0.005, 64, timed_alone=True)
    assert 0.004 <= arms.catch_up_seconds(64) <= 0.005


@pytest.mark.parametrize(("tokens_left", "drafts"), [(16, False), (100, True)])
def test_a_switch_is_charged_for_the_batch_draining_unevenly(tokens_left: int, drafts: bool) -> None:
    """A short catch-up (64 rows, 1 ms) is not all a switch costs: drafting spreads the steps at
    which the batch's requests finish, charged as DRAIN_STEPS steps of the arm (52 ms here).
    16 tokens left save 27 ms, not enough; 100 save 166 ms."""
    arms = MeasuredArms(explore_every=10_000)
    for _ in range(3):
        arms.observe(64, False, NO_SPEC, 0.010, 64)  # 0.156 ms per token
        arms.observe(64, False, CHAIN, 0.026, 200)  # 0.130 ms per token
    arms.observe_catch_up(64, False, CHAIN, 0.010, 640, timed_alone=True)
    chosen = arms.choose(64, False, [NO_SPEC, CHAIN], 64, tokens_left=tokens_left)
    assert chosen == (CHAIN if drafts else NO_SPEC)


def test_the_pooled_yield_weighs_each_step_by_its_sequences() -> None:
    """Forty steps of one easy prompt (5 tokens per step) and then eight of a batch of 16 that
    yields 3: the batch's evidence (128 sequence-steps) outweighs the one prompt's (40)."""
    arms = MeasuredArms()
    for _ in range(40):
        arms.observe(1, False, CHAIN, 0.01, 5)
    for _ in range(8):
        arms.observe(16, False, CHAIN, 0.04, 48)
    for _ in range(3):
        arms.observe(16, False, NO_SPEC, 0.01, 16)
    est = arms.estimate(5, False, CHAIN)
    assert est is not None and est.per_token == pytest.approx(0.04 / (16 * 3), rel=0.15)


def test_batch_16_drafts_though_one_prompts_catch_up_is_dear_per_row() -> None:
    """The H200 case: a one-prompt catch-up costs 13 ms for 64 rows (0.2 ms per row) but 16
    prompts' cost 31 ms, not 210. With the calibrated line, batch 16 behind by its prompts
    switches to the tree that is 1.4x cheaper per token than autoregressive decoding, over the
    200 tokens its requests have left."""
    arms = MeasuredArms(explore_every=10_000)
    arms.catch_up.calibrate([(64, 0.013), (1024, 0.031)])
    for _ in range(3):
        arms.observe(16, False, NO_SPEC, 0.0014, 16)  # 87 us per token
        arms.observe(16, False, TREE, 0.0039, 16 * 4)  # 61 us per token
    arms.observe_catch_up(1, False, TREE, 0.013, 64, timed_alone=True)
    assert arms.choose(16, False, [NO_SPEC, TREE], 1024, tokens_left=200) == TREE
    only_per_row = MeasuredArms(explore_every=10_000)
    for _ in range(3):
        only_per_row.observe(16, False, NO_SPEC, 0.0014, 16)
        only_per_row.observe(16, False, TREE, 0.0039, 16 * 4)
    only_per_row.observe_catch_up(1, False, TREE, 0.013, 64, timed_alone=True)
    assert only_per_row.choose(16, False, [NO_SPEC, TREE], 1024, tokens_left=200) == NO_SPEC


def test_a_choice_stands_a_few_steps_then_is_made_afresh() -> None:
    """Making the choice costs host time every step; it stands HOLD_STEPS steps of the same
    bucket (while the MTP modules stay behind, or caught up), then new costs decide."""
    from engine.spec.arms import HOLD_STEPS

    arms = MeasuredArms(explore_every=10_000)
    for _ in range(3):
        arms.observe(16, False, NO_SPEC, 0.001, 16)
        arms.observe(16, False, CHAIN, 0.004, 32)
    assert arms.choose(16, False, [NO_SPEC, CHAIN]) == NO_SPEC
    for _ in range(6):
        arms.observe(16, False, CHAIN, 0.001, 64)  # the chain becomes 4x cheaper
    held = [arms.choose(16, False, [NO_SPEC, CHAIN]) for _ in range(HOLD_STEPS)]
    assert held == [NO_SPEC] * (HOLD_STEPS - 1) + [CHAIN]


def test_a_switch_waits_for_autoregressive_decoding_measured_in_the_bucket() -> None:
    """The H200's batch 64: autoregressive steps measured only at batches 1 and 4, the second
    on a slow moment, draw a line that puts batch 64 at 10 ms a step (1.8 ms measured); a chain
    measured at 16 then looks worth its catch-up of 64 prompts. No switch until autoregressive
    decoding is measured in the bucket, and then the catch-up does not pay for 64 tokens."""
    arms = MeasuredArms(explore_every=10_000)
    arms.catch_up.calibrate([(64, 0.013), (1024, 0.031), (4096, 0.046)])
    for _ in range(3):
        arms.observe(1, False, NO_SPEC, 0.00118, 1)
        arms.observe(4, False, NO_SPEC, 0.0016, 4)  # a slow moment
        arms.observe(16, False, CHAIN, 0.0022, 16 * 3)
    est = arms.estimate(7, False, NO_SPEC)
    assert est is not None and est.step > 0.008  # the line drawn out to 64
    lag = 64 * 55
    for i in range(8):
        assert arms.choose(64, False, [NO_SPEC, CHAIN], lag, tokens_left=64 - i) == NO_SPEC
        arms.observe(64, False, NO_SPEC, 0.00184, 64)
        lag += 64


def test_a_switch_is_weighed_against_autoregressive_decoding_at_its_floor() -> None:
    """Autoregressive steps of 1.8 ms, then a stretch at 2.4 ms (a busy host) that lifts their
    average to 2.24 ms: a switch is weighed against what they cost undisturbed (the floor rises
    slowly). 64 tokens x 64 sequences of a chain at 21.9 us per token save 54 ms against the
    average, 36 ms against the floor: not worth a 37 ms catch-up and two 4.2 ms steps; twice
    the tokens are."""

    def measured() -> MeasuredArms:
        arms = MeasuredArms(explore_every=10_000)
        arms.catch_up.calibrate([(64, 0.013), (4096, 0.0366)])
        for _ in range(3):
            arms.observe(64, False, CHAIN, 0.0042, 64 * 3)
        for seconds in [0.0018] * 4 + [0.0024] * 6:
            arms.observe(64, False, NO_SPEC, seconds, 64)
        return arms

    cost = measured()._bucket(7, False).costs[NO_SPEC]
    assert cost.seconds > 0.0022 and cost.floor < 0.0020 / 64
    assert measured().choose(64, False, [NO_SPEC, CHAIN], 4096, tokens_left=64) == NO_SPEC
    assert measured().choose(64, False, [NO_SPEC, CHAIN], 4096, tokens_left=128) == CHAIN


@pytest.mark.parametrize("filling", [False, True])
def test_no_switch_to_drafting_while_the_batch_is_still_filling(filling: bool) -> None:
    """As at the H200's batch 256: 64 of its prompts decode while the rest are admitted. A
    catch-up now would be followed by the newcomers' own, and the batch lands in another
    bucket: the switch waits until the batch has filled."""
    arms = MeasuredArms(explore_every=10_000)
    for _ in range(3):
        arms.observe(64, False, NO_SPEC, 0.010, 64)
        arms.observe(64, False, CHAIN, 0.026, 200)  # cheaper per token: worth a switch
    arms.observe_catch_up(64, False, CHAIN, 0.026 + 0.010, 640)
    chosen = arms.choose(64, False, [NO_SPEC, CHAIN], 6400, tokens_left=200, filling=filling)
    assert chosen == (NO_SPEC if filling else CHAIN)
    # Once drafting (nothing to catch up), newcomers being admitted do not stop it.
    assert arms.choose(64, False, [NO_SPEC, CHAIN], 0, tokens_left=200, filling=True) == CHAIN


@pytest.mark.parametrize(("tokens_left", "explores"), [(10, False), (200, True)])
def test_a_run_measuring_an_arm_from_a_larger_batch_needs_the_time_to_pay_its_catch_up(
    tokens_left: int, explores: bool
) -> None:
    """The H200's batch 256 at its end, 181 sequences left with 10 tokens to go: the chain,
    measured at 256 only, is worth measuring at 181, but not for a 71 ms catch-up of 16768
    rows; with 200 tokens to go it is."""
    arms = MeasuredArms(explore_every=16)
    arms.catch_up.calibrate([(4096, 0.014), (16768, 0.071)])  # graphed catch-ups on the H200
    for _ in range(3):
        arms.observe(256, False, NO_SPEC, 0.0035, 256)
        arms.observe(256, False, CHAIN, 0.0135, 870)
    chosen = [arms.choose(181, False, [NO_SPEC, CHAIN], 16768, tokens_left) for _ in range(40)]
    assert (CHAIN in chosen) == explores, chosen


def test_two_drafting_arms_this_close_are_told_apart_by_more_than_their_first_steps() -> None:
    """The H200 at batch 1: chain and tree within 5% per token. The tree's first steps were
    a little slow (0.46 against the chain's 0.425 ms per token), so the chain looked cheaper; the
    tree is re-run soon, not after ~190 steps, and then carries the batch."""
    arms = MeasuredArms()
    costs = {NO_SPEC: (0.0016, 1), CHAIN: (0.0017, 4), TREE: (0.0021, 5)}  # 0.42 vs 0.40 ms/token
    tree_runs = 0
    chosen: list[TreeBudget] = []
    for _ in range(200):
        arm = arms.choose(1, False, ARMS)
        seconds, tokens = costs[arm]
        if arm == TREE:
            tree_runs += 1
            if tree_runs <= 3:
                seconds = 0.0023  # its first steps: slow
        arms.observe(1, False, arm, seconds, tokens)
        chosen.append(arm)
    tail = chosen[100:]
    assert tail.count(TREE) >= 0.7 * len(tail), (tail.count(TREE), tail.count(CHAIN))


@pytest.mark.parametrize(("spread", "closed", "drafts"), [
    ((0.95, 1.05), True, True),  # yields alike: the batch finishes together, drafting wins
    ((0.35, 1.65), True, False),  # a wide spread: the last steps carry few sequences
    ((0.35, 1.65), False, True),  # requests waiting refill the batch: no drain
])  # fmt: skip
def test_a_closed_batch_drafting_is_charged_for_its_drain_from_the_spread_of_yields(
    spread: tuple[float, float], closed: bool, drafts: bool
) -> None:
    """Batch 64 drafting (nothing to catch up), 64 tokens left: a chain step costs 5.6 ms for
    3.4 tokens a sequence, an AR step 2.2 ms, so steady drafting is 25% cheaper per token
    (as on the H200). With yields spread from 0.35 to 1.65 of the mean the hardest sequences
    need 2.8x the mean's steps, at a step that costs 2 ms with a few sequences left: it loses."""
    arms = MeasuredArms(explore_every=10_000)
    for b, ar_ms, chain_ms in ((4, 1.3, 2.0), (64, 2.2, 5.6)):
        for _ in range(3):
            arms.observe(b, False, NO_SPEC, ar_ms * 1e-3, b)
            arms.observe(b, False, CHAIN, chain_ms * 1e-3, round(3.4 * b))
    low, high = spread
    for i in range(32):
        r = low + (high - low) * i / 31
        arms.observe_finished(r * 40.0, 40.0, 12)
    assert arms.spread.ready
    chosen = arms.choose(64, False, [NO_SPEC, CHAIN], 0, tokens_left=64, closed=closed)
    assert chosen == (CHAIN if drafts else NO_SPEC)


def test_the_mean_yield_is_every_step_of_the_arm() -> None:
    arms = MeasuredArms()
    assert arms.mean_yield(False, CHAIN) == 1.0
    arms.observe(1, False, CHAIN, 0.01, 5)
    arms.observe(3, False, CHAIN, 0.01, 3)
    assert arms.mean_yield(False, CHAIN) == pytest.approx(8 / 4)
    assert arms.mean_yield(True, CHAIN) == 1.0


def test_an_arm_yield_is_the_prediction_averaged_with_the_measurement() -> None:
    arms = MeasuredArms()
    assert arms.arm_yield(False, TREE) is None
    arms.set_predicted_yield(False, TREE, 5.0)
    assert arms.arm_yield(False, TREE) == 5.0  # nothing measured: the model alone
    arms.observe(1, False, TREE, 0.002, 2)  # one sequence-step yielding 2 tokens
    assert arms.arm_yield(False, TREE) == pytest.approx((2.0 * 1 + 5.0 * 16) / (1 + 16))
    for _ in range(400):  # a long record: the EWMA counts as 1 / YIELD_RATE = 50 sequence-steps
        arms.observe(8, False, TREE, 0.004, 24)
    assert arms.arm_yield(False, TREE) == pytest.approx((3.0 * 50 + 5.0 * 16) / (50 + 16), rel=1e-3)
    arms.observe(1, False, CHAIN, 0.002, 3)
    assert arms.arm_yield(False, CHAIN) == 3.0  # no prediction: the measurement alone
    with pytest.raises(ValueError, match="at least 1 token"):
        arms.set_predicted_yield(False, TREE, 0.5)
    with pytest.raises(ValueError, match="weight"):
        arms.set_predicted_yield(False, TREE, 2.0, weight=0.0)


def test_a_weak_prediction_yields_to_a_few_measured_steps() -> None:
    """A prior that knows rank 0 only (a model folder's training log) under-predicts a tree;
    set with the weight of one sequence-step, three measured steps outweigh it."""
    arms = MeasuredArms()
    arms.set_predicted_yield(False, TREE, 3.7, weight=1.0)
    for _ in range(3):
        arms.observe(1, False, TREE, 0.0013, 5)
    assert arms.arm_yield(False, TREE) == pytest.approx((5.0 * 3 + 3.7) / 4)


def test_an_arm_seen_on_a_few_poor_steps_is_valued_by_the_model() -> None:
    """Batch 1: the tree explored for three steps on a prompt that accepted little, the chain
    measured for long. The model of the pooled statistics puts the tree's yield above the
    chain's; with it the tree wins at equal step costs, without it the few steps decide."""

    def run(predict: bool) -> TreeBudget:
        arms = MeasuredArms(explore_every=10_000)
        for _ in range(3):
            arms.observe(1, False, NO_SPEC, 0.0011, 1)
        for _ in range(3):
            arms.observe(1, False, TREE, 0.0019, 2)
        for _ in range(60):
            arms.observe(1, False, CHAIN, 0.0015, 3)
        if predict:
            arms.set_predicted_yield(False, TREE, 5.2)
            arms.set_predicted_yield(False, CHAIN, 3.2)
        return arms.choose(1, False, ARMS)

    assert run(predict=False) == CHAIN
    assert run(predict=True) == TREE


def test_counterfactual_yields_move_the_yield_not_the_costs() -> None:
    """What an arm would have yielded in another arm's step (the chain's share of a tree step's
    path) counts as evidence of its yield; its step costs and lifetime tokens stay its own."""
    arms = MeasuredArms()
    chain = TreeBudget(topk=1, depth=4, num_draft_tokens=4)
    arms.observe_counterfactual_yield(4, False, chain, 12)  # 3 tokens per sequence
    assert arms.arm_yield(False, chain) == pytest.approx(3.0)
    assert arms.mean_yield(False, chain) == 1.0 and not arms.cost_table()
    arms.observe_counterfactual_yield(1, False, TreeBudget(topk=1, depth=0, num_draft_tokens=0), 1)
    assert arms.arm_yield(False, TreeBudget(topk=1, depth=0, num_draft_tokens=0)) is None


def _seeded(batches: tuple[int, ...], step_ms: dict[TreeBudget, tuple[float, float]]) -> MeasuredArms:
    """Arms whose step times were calibrated at start-up: ``step_ms[arm]`` = (ms at batch 1,
    ms per further sequence); no yield known yet."""
    arms = MeasuredArms(explore_every=16)
    for b in batches:
        for arm, (fixed, per_seq) in step_ms.items():
            arms.seed_cost(b, False, arm, (fixed + per_seq * (b - 1)) / 1000)
    return arms


CALIBRATED = {NO_SPEC: (1.2, 0.01), CHAIN: (1.5, 0.025), TREE: (1.65, 0.05)}  # the H200's shape


def test_calibrated_step_times_need_no_run_to_be_known_at_any_batch_size() -> None:
    """Seeded costs count as measured in their bucket: the estimate at batch 256 is the
    calibration's, not a line drawn out from the smaller batches the requests ran at."""
    arms = _seeded((1, 4, 16, 64, 256), CALIBRATED)
    for arm in ARMS:
        est = arms.estimate(9, False, arm)
        assert est is not None and est.measured and est.source == 9
        assert est.step == pytest.approx((CALIBRATED[arm][0] + 255 * CALIBRATED[arm][1]) / 1000)
    # The calibration's time is kept beside the cost the served steps move.
    arms.observe(256, False, CHAIN, 0.009, 800)
    cost = arms.bucket_costs(256, False)[CHAIN]
    assert cost.served == 1 and cost.calibrated == pytest.approx((1.5 + 255 * 0.025) / 1000)
    assert cost.seconds > cost.calibrated
    with pytest.raises(ValueError, match="positive"):
        arms.seed_cost(1, False, TREE, 0.0)


def test_a_calibrated_arm_is_run_once_soon_to_learn_its_yield() -> None:
    """At batch 1 the drafting arms' yields are unknown until they ran (a calibrated step counts
    one token per sequence): each is run within the first steps (its yield learnt once serves
    every batch size), then the cheapest stays."""
    arms = _seeded((1,), CALIBRATED)
    costs = {NO_SPEC: (0.0012, 1), CHAIN: (0.0015, 3), TREE: (0.00165, 5)}
    chosen = _drive_batch_1(arms, costs, 60)
    assert CHAIN in chosen[:8] and TREE in chosen[:8]
    assert chosen[20:].count(TREE) >= 0.85 * len(chosen[20:])


def _drive_batch_1(arms: MeasuredArms, costs: dict[TreeBudget, tuple[float, int]], steps: int) -> list[TreeBudget]:
    chosen = []
    for _ in range(steps):
        arm = arms.choose(1, False, ARMS, 0, tokens_left=200)
        arms.observe(1, False, arm, *costs[arm])
        chosen.append(arm)
    return chosen


def test_no_run_to_learn_a_yield_whose_catch_up_the_horizon_cannot_pay() -> None:
    """A batch of 256 prompts decoded autoregressively: catching the modules up over their rows
    (50 ms) to learn a drafting arm's yield does not fit the share of the 64 tokens left that a
    run may take, so none is run; autoregressive decoding carries every step."""
    arms = _seeded((256,), CALIBRATED)
    arms.catch_up.observe(16384, 0.05)
    chosen = [arms.choose(256, False, ARMS, 16384, tokens_left=64) for _ in range(40)]
    assert chosen == [NO_SPEC] * 40



@pytest.mark.parametrize(("chain", "tree", "drafts"), [(3.2, 3.7, True), (1.5, 1.6, False)])
def test_a_predicted_yield_lets_a_large_batch_draft_without_an_exploring_run(
    chain: float, tree: float, drafts: bool
) -> None:
    """The same batch of 256 with the arms' yields predicted (the model folder's acceptance
    prior, before any verify step): where the chain's saving over the 128 tokens left pays its
    catch-up and drain, the batch drafts at once rather than never learning what drafting yields; a poor model's prior (1.5 tokens a
    step) keeps it autoregressive."""
    arms = _seeded((256,), CALIBRATED)
    arms.catch_up.observe(16384, 0.05)
    arms.set_predicted_yield(False, CHAIN, chain)
    arms.set_predicted_yield(False, TREE, tree)
    assert arms.choose(256, False, ARMS, 16384, tokens_left=128) == (CHAIN if drafts else NO_SPEC)


@pytest.mark.parametrize(("served_at_128", "served_at_256", "drafts"), [
    (True, False, False), (False, False, True), (True, True, True),
])  # fmt: skip
def test_an_autoregressive_step_only_calibrated_costs_at_most_one_served_at_a_smaller_batch(
    served_at_128: bool, served_at_256: bool, drafts: bool
) -> None:
    """Batch 256's autoregressive step calibrated at 1.8 ms (7.0 us per token) makes a chain at
    3.1 us per token save 65 ms over 64 tokens, far above its 10 ms catch-up and 5 ms drain; but
    steps served at batch 128 took 0.95 ms, and a larger batch's step costs no less: weighed at
    3.7 us per token the saving is 10 ms, and the batch decodes autoregressively. Without served
    steps at a smaller batch the calibration stands, and so do steps served at 256 themselves."""
    arms = MeasuredArms(explore_every=10_000)
    arms.seed_cost(128, False, NO_SPEC, 0.00118)
    arms.seed_cost(256, False, NO_SPEC, 0.0018)
    arms.catch_up.calibrate([(64, 0.002), (16384, 0.010)])
    for _ in range(3):
        arms.observe(256, False, CHAIN, 0.0026, round(256 * 3.3))
        if served_at_128:
            arms.observe(128, False, NO_SPEC, 0.00095, 128)
        if served_at_256:
            arms.observe(256, False, NO_SPEC, 0.0018, 256)
    asked = arms.drafting_arm(256, False, [NO_SPEC, CHAIN], 16384, 64)
    assert asked == (CHAIN if drafts else None)
    assert arms.choose(256, False, [NO_SPEC, CHAIN], 16384, tokens_left=64) == (CHAIN if drafts else NO_SPEC)


def test_a_drafting_cost_only_calibrated_is_served_then_decides() -> None:
    """Calibrated over random prompts, a drafting step may miss host work that served steps do
    (the H200's chain at batch 256: 3.2 ms served against 2.6 calibrated). A switch whose saving
    over the 64 tokens left pays its catch-up and drain on the calibration (82 ms against 66) is
    made, so that the arm's steps are served; where they cost twice the calibration, the choices
    after them are autoregressive."""
    arms = _seeded((256,), CALIBRATED)
    arms.catch_up.observe(16384, 0.05)
    arms.set_predicted_yield(False, CHAIN, 3.2)
    arms.set_predicted_yield(False, TREE, 3.7)
    assert arms.choose(256, False, ARMS, 16384, tokens_left=64) == CHAIN
    for _ in range(8):
        arms.observe(256, False, CHAIN, 2 * (1.5 + 255 * 0.025) / 1000, round(256 * 3.2))
    assert arms.choose(256, False, ARMS, 0, tokens_left=56) == NO_SPEC


def test_no_run_of_a_dear_arm_to_learn_its_yield_where_a_small_batch_would_learn_it_cheaply() -> None:
    """A batch of 256 drafting with the chain, caught up: three steps of the tree (20 ms each
    against the chain's 8) to learn its yield cost more than the share of the 64 tokens left
    that a run may take, so the chain carries every step; at batch 1, where a tree step costs
    about a chain step, the tree is run within the first steps."""
    arms = _seeded((1, 256), CALIBRATED)
    arms.set_predicted_yield(False, CHAIN, 3.2)
    for _ in range(3):
        arms.observe(256, False, CHAIN, 0.0079, round(256 * 3.2))
        arms.observe(256, False, NO_SPEC, 0.0037, 256)
    arms._yield[(False, CHAIN)] = (3.2, 1000)  # the chain's yield measured, the tree's not
    chosen = [arms.choose(256, False, ARMS, 0, tokens_left=64) for _ in range(40)]
    assert TREE not in chosen and chosen.count(CHAIN) == 40
    small = [arms.choose(1, False, ARMS, 0, tokens_left=64) for _ in range(8)]
    assert TREE in small


@pytest.mark.parametrize(("tokens_left", "drafts"), [(200, True), (10, False)])
def test_a_filling_batch_asks_whether_it_will_draft_once_full_without_choosing(
    tokens_left: int, drafts: bool
) -> None:
    """``drafting_arm`` answers for the batch a fill becomes (the engine then catches each
    prefill chunk up as it goes): the chain, if its saving over the horizon clears the catch-up
    of every prompt (64 prompts of 100 rows here), else None; asking records nothing, so the
    choices that follow are what they would have been."""
    def measured() -> MeasuredArms:
        arms = MeasuredArms(explore_every=10_000)
        for _ in range(3):
            arms.observe(64, False, NO_SPEC, 0.010, 64)
            arms.observe(64, False, CHAIN, 0.026, 200)  # 0.13 ms per token against 0.16
        arms.catch_up.calibrate([(64, 0.004), (6400, 0.012)])
        return arms

    arms = measured()
    asked = arms.drafting_arm(64, False, [NO_SPEC, CHAIN], 6400, tokens_left)
    assert asked == (CHAIN if drafts else None)
    # The terms weighed are kept for diagnosis: the saving over the horizon (64 sequences, at
    # most 200 tokens each, 0.03 ms per token saved) against the catch-up and 2 steps' drain.
    weighing = arms.last_weighing
    assert weighing is not None and weighing.arm == CHAIN and weighing.pays == drafts
    assert weighing.saving == pytest.approx(64 * tokens_left * (0.010 / 64 - 0.026 / 200))
    assert weighing.catch_up == pytest.approx(arms.catch_up_seconds(6400))
    assert weighing.drain == pytest.approx(2 * 0.026) and weighing.margin == 1.0
    assert arms.drafting_arm(64, False, [NO_SPEC, CHAIN], 6400, tokens_left, closed=True) == asked
    # Nothing known at a batch size or no catch-up cost known: no answer.
    assert arms.drafting_arm(64, True, [NO_SPEC, CHAIN], 6400, tokens_left) is None
    fresh = MeasuredArms()
    assert fresh.drafting_arm(64, False, [NO_SPEC, CHAIN], 6400, tokens_left) is None
    # The next choices are those of an instance never asked.
    other = measured()
    for lag in (6400, 6400, 0, 0):
        assert arms.choose(64, False, [NO_SPEC, CHAIN], lag, tokens_left) == other.choose(
            64, False, [NO_SPEC, CHAIN], lag, tokens_left)  # fmt: skip


def _filling(chain_fill: float, steps: int, per_fill: int = 3) -> tuple[MeasuredArms, list[TreeBudget]]:
    """Filling steps at batch 32 where the chain is the steady choice (12.5 us per token
    against 31 for autoregressive steps) and a filling step costs ``chain_fill`` seconds
    drafting, 1.5 ms autoregressive (the prefill in both), in fills of ``per_fill`` filling
    steps, each followed by a steady step (not listed)."""
    arms = MeasuredArms(explore_every=10_000)
    for _ in range(3):
        arms.observe(32, False, NO_SPEC, 0.0010, 32)
        arms.observe(32, False, CHAIN, 0.0016, 128)
    chosen = []
    for i in range(steps):
        if i and i % per_fill == 0:  # the fill ends
            arms.choose(32, False, [NO_SPEC, CHAIN], 0, tokens_left=200)
        arm = arms.choose(32, False, [NO_SPEC, CHAIN], 0, tokens_left=200, filling=True, filled_batch=32)
        arms.observe_filling(32, False, arm, chain_fill if arm.speculates else 0.0015, 128 if arm.speculates else 32)
        chosen.append(arm)
    return arms, chosen


@pytest.mark.parametrize(("chain_fill", "drafts"), [(0.0032, False), (0.0017, True)])
def test_a_filling_step_drafts_only_where_its_filling_steps_pay(chain_fill: float, drafts: bool) -> None:
    """As the demo model's batch 64 filling by 128-token prefill chunks on an H200: a tree step
    next to a prefill took ~3.2 ms, an autoregressive one ~1.5 ms, and drafting through the fill
    ran 0.75-0.89x autoregressive decoding. Drafting's filling steps are measured first, then
    the autoregressive one's; then the chain drafts only if its 3 extra tokens per sequence,
    worth 1.2 ms at its steady 12.5 us per token, cost less than that beyond the
    autoregressive filling step (0.2 ms does, 1.7 ms does not). The steady costs stay."""
    arms, chosen = _filling(chain_fill, 12)
    assert chosen[:3] == [CHAIN] * 3 and chosen[3:6] == [NO_SPEC] * 3
    assert set(chosen[6:]) == {CHAIN if drafts else NO_SPEC}
    assert arms.per_token(6, False, CHAIN) == pytest.approx(0.0016 / 128)
    assert arms.per_token(6, False, NO_SPEC) == pytest.approx(0.0010 / 32)
    fills = {arm: cost for _, arm, cost in arms.fill_cost_table()}
    assert set(fills) == {CHAIN, NO_SPEC} and fills[CHAIN].seconds == pytest.approx(chain_fill)


@pytest.mark.parametrize("drafts", [False, True])
def test_the_filling_arm_not_chosen_is_re_run_now_and_then(drafts: bool) -> None:
    """Once both filling costs are known, the arm not chosen runs once every FILL_REMEASURE
    free filling choices of the bucket (filling steps change with the prompts and the chunk).
    A drafting fill keeps drafting: autoregressive decoding is re-measured at a fill's first
    filling step, up to a fill later than due."""
    from engine.spec.arms import FILL_REMEASURE

    per_fill = 3
    _, chosen = _filling(0.0017 if drafts else 0.0032, 6 + 3 * FILL_REMEASURE, per_fill)
    other = NO_SPEC if drafts else CHAIN
    runs = [i for i, arm in enumerate(chosen) if i >= 6 and arm == other]
    assert len(runs) >= 2
    assert all(FILL_REMEASURE <= b - a <= FILL_REMEASURE + per_fill for a, b in zip(runs, runs[1:], strict=False))
    if drafts:
        assert all(i % per_fill == 0 for i in runs), "at a fill's first filling step"
        for i in runs:  # the rest of that fill: the chain, whose filling step pays
            assert chosen[i + 1 : i + per_fill] == [CHAIN] * (per_fill - 1)


def test_a_drafting_fill_keeps_drafting_until_it_ends() -> None:
    """A fill whose first filling steps drafted (the measured filling costs say it pays) keeps
    the arm in its later ones even where its bucket's steady costs would now decode
    autoregressively (the H200's batch 256: an autoregressive step at 128 sequences left the
    batch behind, and the first full step took 10-22 ms against ~6). Lag still decodes
    autoregressively, and a step without a prefill ends the fill."""
    arms, _ = _filling(0.0017, 9)  # both filling costs measured: the chain's pays
    assert arms.choose(32, False, [NO_SPEC, CHAIN], 0, tokens_left=200) == CHAIN  # a fill ends
    assert arms.choose(32, False, [NO_SPEC, CHAIN], 0, tokens_left=200, filling=True, filled_batch=64) == CHAIN
    for _ in range(5):  # batch 64's steady steps now say autoregressive decoding wins there
        arms.observe(64, False, NO_SPEC, 0.0010, 64)
        arms.observe(64, False, CHAIN, 0.0100, 256)
    assert arms.choose(64, False, [NO_SPEC, CHAIN], 0, tokens_left=200, filling=True, filled_batch=64) == CHAIN
    assert arms.choose(64, False, [NO_SPEC, CHAIN], 64, tokens_left=200, filling=True) == NO_SPEC  # behind
    assert arms.choose(64, False, [NO_SPEC, CHAIN], 0, tokens_left=200) == NO_SPEC  # the fill ended
    assert arms.choose(64, False, [NO_SPEC, CHAIN], 0, tokens_left=200, filling=True, filled_batch=64) == NO_SPEC


def _request_alone(arms: MeasuredArms, step_s: dict[TreeBudget, float], yields: dict[TreeBudget, int]) -> list[TreeBudget]:
    """One 64-token request at batch 1, its prompt (64 rows) not caught up: every step as the
    engine runs it (a drafting step after autoregressive ones catches up first, timed apart)."""
    lag, left, chosen = 64, 64, []
    while left > 0:
        arm = arms.choose(1, False, ARMS, lag, tokens_left=left, closed=True)
        tokens = min(yields[arm], left)
        arms.observe(1, False, arm, step_s[arm], tokens)
        lag = lag + 1 if not arm.speculates else 0
        left -= tokens
        chosen.append(arm)
    return chosen


def test_a_yield_measured_on_a_few_poor_steps_is_measured_again_as_time_is_served() -> None:
    """The demo model on an H200: batch-1 requests of 64 tokens arriving one at a time. The
    warm-up's runs of the tree and the chain (first steps, dearer than steady ones) on a hard
    stretch put their yields at 2.4 and 2.0 tokens, no better per token than an autoregressive
    step, and a run to re-measure either (its catch-up, ~1 ms) never fit the share of one
    request's horizon a run may take (~0.4 ms), so the engine never drafted again (the demo's
    check: 126 autoregressive steps in 2 requests, 1.00x). A yield seen on so few
    sequence-steps is re-measured once the time served since the arm's last run pays for the
    run at that share: within two requests, after which drafting carries the requests."""
    step_s = {NO_SPEC: 0.00033, CHAIN: 0.00064, TREE: 0.00078}
    yields = {NO_SPEC: 1, CHAIN: 4, TREE: 5}
    arms = MeasuredArms(explore_every=16)
    for arm, ms in ((NO_SPEC, 0.30), (CHAIN, 0.51), (TREE, 0.67)):
        arms.seed_cost(1, False, arm, ms / 1000)
    arms.catch_up.calibrate([(16, 0.0006), (64, 0.001)])
    arms.set_predicted_yield(False, CHAIN, 3.2, weight=1.0)
    arms.set_predicted_yield(False, TREE, 3.7, weight=1.0)
    for chain in (2, 1, 2):  # the warm-up's runs
        arms.observe(1, False, NO_SPEC, step_s[NO_SPEC], 1)
        arms.observe(1, False, CHAIN, 0.0008, chain)
        arms.observe(1, False, TREE, 0.0009, 2)
    ar = arms.per_token(1, False, NO_SPEC)
    assert ar is not None and all(arms.per_token(1, False, arm) >= ar for arm in (CHAIN, TREE))  # type: ignore[operator]
    assert arms.choose(1, False, ARMS, 64, tokens_left=64, closed=True) == NO_SPEC
    first_two = _request_alone(arms, step_s, yields) + _request_alone(arms, step_s, yields)
    assert any(arm.speculates for arm in first_two)
    later = [arm for _ in range(6) for arm in _request_alone(arms, step_s, yields)]
    assert sum(arm.speculates for arm in later) > 0.8 * len(later)


def test_a_thin_yield_is_re_measured_at_a_large_batch_when_the_time_served_pays_for_the_run() -> None:
    """A batch of 64 decoding autoregressively (1 ms a step) after 300 such steps, the tree's
    yield seen on three batch-1 steps only: a run of it costs what its ~400 tokens cost beyond
    the chosen arm's (~2.5 ms), well within a tenth of the 300 ms served, so it runs now; a run
    counted once per sequence over (64 times as dear) would not."""
    arms = MeasuredArms(explore_every=16)
    arms.seed_cost(64, False, NO_SPEC, 0.001)
    arms.seed_cost(64, False, TREE, 0.003)
    arms.set_predicted_yield(False, TREE, 2.0, weight=1.0)
    for _ in range(3):
        arms.observe(1, False, TREE, 0.0009, 2)
    for _ in range(300):
        arms.observe(64, False, NO_SPEC, 0.001, 64)
    assert arms.choose(64, False, [NO_SPEC, TREE], 0, tokens_left=64, closed=True) == TREE


def test_a_drafting_arm_only_calibrated_is_run_where_as_calibrated_it_pays() -> None:
    """A closed batch of 16 sampled requests (the H200's T=0.7 sweep, session 35): autoregressive
    steps served at 0.76 ms, the chain calibrated at 1.43 ms for 3.3 tokens a sequence (0.027
    against 0.048 ms per token), its yield known from batch 1, a spread of yields that makes the
    drain dear. Weighed with the margin a calibrated cost had to clear until session 34, a
    switch never paid, so the chain never ran, was never served, and the batch decoded
    autoregressively for all its 630 steps (0.95-0.99x). As calibrated it pays: it runs within
    the first steps and, served at its calibrated cost, is chosen from then on."""
    arms = MeasuredArms(explore_every=16)
    arms.seed_cost(16, True, NO_SPEC, 0.00076)
    arms.seed_cost(16, True, CHAIN, 0.00143)
    for _ in range(40):
        arms.observe(1, True, CHAIN, 0.0016, 3)
        arms.observe(1, True, NO_SPEC, 0.0009, 1)
    arms.catch_up.calibrate([(64, 0.0004), (1024, 0.0015)])
    for i in range(32):  # relative yields 0.6-1.5
        arms.observe_finished(20 * (0.6 + 0.9 * i / 31), 20.0, 20)
    chosen, lag = [], 16 * 64
    for step in range(120):
        arm = arms.choose(16, True, [NO_SPEC, CHAIN], lag, tokens_left=63 - step % 63, closed=True)
        arms.observe(16, True, arm, *((0.00076, 16) if arm == NO_SPEC else (0.00143, 53)))
        lag = lag + 16 if arm == NO_SPEC else 0
        chosen.append(arm)
    assert CHAIN in chosen[:20]
    assert chosen[20:].count(CHAIN) >= 0.9 * len(chosen[20:])
