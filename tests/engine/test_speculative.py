"""Speculative decoding is lossless: greedy output equals autoregressive and transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.spec.adaptive import NO_SPEC, budget_label
from engine.spec.drafter import TreeBudget, steady_catch_up_rows
from train.heldout import heldout_prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 0, 1], [2, 3], [4] * 20, [5, 1]]
SPECS = [
    SpecConfig(method="chain"),
    SpecConfig(method="chain", num_draft_tokens=6),
    SpecConfig(method="tree"),
    SpecConfig(method="tree", topk=3, depth=6, num_draft_tokens=12),
    SpecConfig(method="tree", topk=2, depth=3, num_draft_tokens=4, reuse_last_module=False),
    SpecConfig(method="adaptive"),
]


def _run(folder: Path, spec: SpecConfig, sampling: SamplingParams = GREEDY, **kw):  # type: ignore[no-untyped-def]
    return LLMEngine.from_pretrained(folder, spec=spec, **kw).generate(PROMPTS, sampling)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-{s.topk}-{s.num_draft_tokens}")
def test_greedy_speculation_equals_autoregressive(small_vocab_dir: Path, spec: SpecConfig) -> None:
    base = _run(small_vocab_dir, SpecConfig(method="none"))
    outs = _run(small_vocab_dir, spec)
    for b, o in zip(base, outs, strict=True):
        assert o.token_ids == b.token_ids
    total_accepted = sum(o.stats.num_accepted_tokens for o in outs)
    if spec.method != "adaptive":  # adaptive may rightly decide not to speculate here
        assert total_accepted > 0, "the test should exercise accepted drafts"
    for o in outs:
        s = o.stats
        assert s.num_steps > 0
        if spec.method != "adaptive":
            assert s.num_draft_tokens >= s.num_steps
        assert s.mean_accepted_length == pytest.approx(1 + s.num_accepted_tokens / s.num_steps)
        assert sum(s.accepted_per_position) == s.num_accepted_tokens
        assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:], strict=False))


def test_greedy_speculation_moe(small_vocab_moe_dir: Path) -> None:
    base = _run(small_vocab_moe_dir, SpecConfig(method="none"))
    for spec in (SpecConfig(method="chain"), SpecConfig(method="tree")):
        outs = _run(small_vocab_moe_dir, spec)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base]


def test_stop_inside_accepted_path(small_vocab_dir: Path) -> None:
    """A stop token met in the middle of an accepted path ends the output right there."""
    base = _run(small_vocab_dir, SpecConfig(method="none"))
    stop = base[2].token_ids[5]
    sp = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))
    want = _run(small_vocab_dir, SpecConfig(method="none"), sp)
    got = _run(small_vocab_dir, SpecConfig(method="tree", topk=3, num_draft_tokens=12), sp)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
    assert got[2].token_ids[-1] == stop and got[2].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(small_vocab_dir: Path) -> None:
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=7)
    a = _run(small_vocab_dir, SpecConfig(method="tree"), sp)
    b = _run(small_vocab_dir, SpecConfig(method="tree"), sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    unseeded = SamplingParams(max_tokens=30, temperature=1.0)
    c = _run(small_vocab_dir, SpecConfig(method="tree"), unseeded)
    d = _run(small_vocab_dir, SpecConfig(method="tree"), unseeded)
    assert [o.token_ids for o in c] != [o.token_ids for o in d]


def test_seeded_sampling_is_reproducible_under_adaptive_speculation(small_vocab_dir: Path) -> None:
    """Adaptive speculation drafts as the load allows; a seeded request's draws are keyed by
    position (``engine.keyed_noise``), so each gives the same tokens alone as beside other
    requests (greedy, unseeded, other seeds; the batch drafting or not), the tokens no
    speculation gives with that seed."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    prompts = [[1, 2, 3, 4], [2, 5, 1], [3, 3, 0, 1, 2]]

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)

    alone = [eng.generate([p], seeded(7 + i))[0].token_ids for i, p in enumerate(prompts)]
    assert alone == [base.generate([p], seeded(7 + i))[0].token_ids for i, p in enumerate(prompts)]
    for _ in range(2):  # the second time with the arms measured: the batch drafts or not
        for i, p in enumerate(prompts):
            eng.add_request(f"seeded-{i}", p, seeded(7 + i))
        for j in range(6):
            sp = SamplingParams(max_tokens=30, temperature=0.0 if j % 2 else 0.8, ignore_eos=True)
            eng.add_request(f"other-{j}", prompts[j % 3], sp)
        done: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in eng.step() if o.finished)
        assert [done[f"seeded-{i}"] for i in range(3)] == alone
    assert eng.adaptive is not None and sum(eng.adaptive.steps_per_arm.values()) > 0


def test_rejected_tree_slots_are_zeroed(small_vocab_dir: Path) -> None:
    """After a step, no cache entry exists beyond each sequence's committed tokens."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree", topk=3,
                                                                    num_draft_tokens=12))
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    seq = eng._requests["a"]
    for _ in range(6):
        eng.step()
        if seq.status.value != "running":
            break
        bs = eng.pool.block_size
        flat = eng.pool.kv_cache.view(eng.pool.kv_cache.shape[0], -1, eng.pool.kv_cache.shape[-1])
        for layer in range(eng.model_config.num_hidden_layers):
            for pos in range(seq.num_committed, len(seq.block_ids) * bs):
                slot = seq.block_ids[pos // bs] * bs + pos % bs
                assert torch.count_nonzero(flat[layer, slot]) == 0, (layer, pos)
            for pos in range(seq.num_committed):
                slot = seq.block_ids[pos // bs] * bs + pos % bs
                assert torch.count_nonzero(flat[layer, slot]) > 0


def test_freed_blocks_are_zeroed_and_reported(small_vocab_dir: Path) -> None:
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"))
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0.0))
    assert eng.kv_blocks_used == 0
    assert torch.count_nonzero(eng.pool.kv_cache) == 0
    events = eng.drain_zero_events()
    assert len(events) == 1 and events[0].bytes == events[0].blocks * eng.pool.bytes_per_block
    assert eng.pool.zeroed_bytes_total == events[0].bytes


def test_requests_finishing_in_one_step_are_zeroed_together_when_it_ends(small_vocab_dir: Path) -> None:
    """Three requests finishing in the same step: their blocks are zeroed and returned in one
    pool call at the step's end (one device copy and fill, not one per request), each reported;
    an abort outside a step returns its blocks at once."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    calls: list[list[int]] = []
    free = eng.pool.free
    eng.pool.free = lambda blocks: calls.append(list(blocks)) or free(blocks)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"r{i}", [1, 2, 3 + i], params)
    eng.add_request("aborted", [2, 2, 2], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    while len(eng._requests) > 1:
        eng.step()
    assert len(calls) == 1 and len(calls[0]) == len(set(calls[0])) > 0
    assert eng.pool.kv_cache[:, calls[0]].abs().sum().item() == 0
    events = eng.drain_zero_events()
    assert sorted(e.request_id for e in events) == ["r0", "r1", "r2"]  # type: ignore[type-var]
    assert sum(e.bytes for e in events) == len(calls[0]) * eng.pool.bytes_per_block
    used = eng.kv_blocks_used
    eng.abort_request("aborted")
    assert len(calls) == 2 and eng.kv_blocks_used == used - len(calls[1]) == 0
    assert torch.count_nonzero(eng.pool.kv_cache) == 0


def _adaptive_with_cheap_verify(folder: Path):  # type: ignore[no-untyped-def]
    """An adaptive engine whose latency model makes speculation look worthwhile."""
    from engine.simulator import LatencyModel

    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="adaptive"))
    controller = eng.adaptive
    assert controller is not None
    controller.latency = LatencyModel.analytic(verify_fixed=0.01, verify_per_token=1e-6)
    controller._tree = None
    return eng, controller


def test_adaptive_host_path_drafts_the_planned_tree(small_vocab_dir: Path) -> None:
    """Cheap verify tokens -> the planner's tree is a real tree; verify cost growing with every
    token -> no plan, and the configured tree stands in (measurement decides)."""
    from engine.simulator import LatencyModel

    eng, controller = _adaptive_with_cheap_verify(small_vocab_dir)
    planned = controller._planned_tree(eng)
    assert planned.speculates and planned != controller.chain
    assert {controller.choose(eng, 1) for _ in range(12)} == {NO_SPEC, controller.chain, planned}
    controller.latency = LatencyModel.analytic(verify_fixed=1e-6, verify_per_token=0.01)
    controller._tree = None
    assert controller._planned_tree(eng) == eng.budget


@pytest.mark.parametrize("method", ["none", "tree"])
def test_static_padded_forward_gives_the_same_tokens(small_vocab_dir: Path, method: str) -> None:
    """The CUDA-graph input path (padding to batch buckets, scratch block) run eagerly on CPU."""
    from engine import EngineConfig

    spec = SpecConfig(method=method, min_path_prob=0.0)  # type: ignore[arg-type]  # full trees
    base = _run(small_vocab_dir, spec)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec,
                                    engine_config=EngineConfig(cuda_graphs=True))
    static = eng.static_forward
    assert static is not None
    calls = []
    # Greedy tree steps go through the graphed tree step, autoregressive ones through the
    # static target forward: both pad to batch buckets.
    if method == "tree":
        runner = eng.graphed_tree
        assert runner is not None
        original = runner.run
        runner.run = lambda *a: calls.append(1) or original(*a)  # type: ignore[method-assign]
    else:  # autoregressive steps load the static inputs directly (``run_decode``)
        original_decode = static.run_decode
        static.run_decode = lambda *a: calls.append(1) or original_decode(*a)  # type: ignore[method-assign]
    outs = eng.generate(PROMPTS[:3], GREEDY)  # 3 sequences -> padded to the bucket of 4
    assert len(calls) > 5, "the static path should carry the decode steps"
    assert [o.token_ids for o in outs] == [b.token_ids for b in base[:3]]
    scratch = eng.static_scratch_blocks
    assert eng.kv_blocks_used == len(scratch)
    flat = eng.pool.kv_cache[:, scratch]
    assert torch.count_nonzero(flat) == 0, "padding rows must leave nothing behind"


def test_adaptive_measured_costs_decide(small_vocab_dir: Path) -> None:
    """Drafting steps measured costlier per token than AR steps: AR; cheaper: drafting."""
    eng, controller = _adaptive_with_cheap_verify(small_vocab_dir)
    tree, chain = controller._planned_tree(eng), controller.chain
    for _ in range(5):
        controller.observe(4, tree, seconds=0.10, tokens=8)  # 12.5 ms per token
        controller.observe(4, chain, seconds=0.08, tokens=8)  # 10 ms per token
        controller.observe(4, NO_SPEC, seconds=0.02, tokens=4)  # 5 ms per token
    assert sum(controller.choose(eng, 4).speculates for _ in range(200)) <= 10
    for _ in range(20):
        controller.observe(4, tree, seconds=0.01, tokens=8)  # 1.25 ms per token
    assert sum(controller.choose(eng, 4) == tree for _ in range(200)) >= 180


def test_adaptive_explores_costly_speculation_rarely(small_vocab_dir: Path) -> None:
    """When a drafting step costs 30 AR steps and AR is faster per token, re-running the
    drafting arms stays a small share of the time (it was one step in 16, which doubled it)."""
    eng, controller = _adaptive_with_cheap_verify(small_vocab_dir)
    tree, chain = controller._planned_tree(eng), controller.chain
    for _ in range(5):
        for arm in (tree, chain):
            controller.observe(4, arm, seconds=0.30, tokens=16, sampled=True)  # 75 ms per token
        controller.observe(4, NO_SPEC, seconds=0.01, tokens=4, sampled=True)  # 2.5 ms per token
    steps = [controller.choose(eng, 4, sampled=True).speculates for _ in range(20000)]
    assert 0 < sum(steps) * 0.30 <= 0.05 * (len(steps) - sum(steps)) * 0.01


def test_adaptive_sees_the_tokens_a_step_produced_before_truncation(demo_model_dir: Path) -> None:
    """A request ending mid-path (max_tokens) emits fewer tokens than the step accepted; the
    controller must be told what the step produced, or every batch's last steps make
    speculation look costlier than it is and flip the choice to AR."""
    # The static path (eager on CPU). An adaptive engine leaves the MTP catch-up over the prompt
    # to its first speculative step (not a steady one); here it is done after the prefill, as a
    # fixed-tree engine does, so the first decode step is a steady one the controller observes.
    eng = LLMEngine.from_pretrained(demo_model_dir, spec=SpecConfig(method="adaptive"),
                                    engine_config=EngineConfig(cuda_graphs=True))
    assert eng.adaptive is not None
    seen: list[tuple[bool, int]] = []
    eng.adaptive.choose = lambda *args, **kwargs: eng.budget  # type: ignore[method-assign]
    eng.adaptive.observe = (  # type: ignore[method-assign]
        lambda batch, budget, seconds, tokens, sampled=False: seen.append((budget.speculates, tokens))
    )
    prompts = heldout_prompts(str(demo_model_dir), eng.tokenizer, 8, 48)  # type: ignore[arg-type]
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill: each request's first token
    assert eng.drafter is not None
    eng.drafter.catch_up(list(eng._requests.values()))
    outs = eng.step()  # one speculative decode step, truncated to one token per request
    assert [len(o.new_token_ids) for o in outs] == [1] * 8 and all(o.finished for o in outs)
    produced = sum(o.step_accepted + 1 for o in outs)
    assert seen == [(True, produced)]
    assert produced > 8, "drafts were accepted past max_tokens"


def test_adaptive_batch_summary_is_updated_after_autoregressive_steps(small_vocab_dir: Path) -> None:
    """Over autoregressive steps of an unchanged batch the summary the choice reads is updated,
    not re-read: tokens left exactly, rows behind at most a steady step's slack per sequence
    over; a batch that changes (a request finishes) is read afresh. It is re-read once after
    SUMMARY_REFRESH steps, when every sequence is past the slack: from then on it is exact."""
    from engine.spec.batch_choice import SUMMARY_REFRESH, summarize

    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    eng.adaptive.choose = lambda *a, **k: NO_SPEC  # type: ignore[method-assign]
    for i, n in enumerate((12, 20 + 2 * SUMMARY_REFRESH, 20 + 2 * SUMMARY_REFRESH)):
        eng.add_request(f"r{i}", [i, 1, 2, 3, 4], SamplingParams(max_tokens=n, temperature=0.0))
    slack = steady_catch_up_rows(eng.budget.depth)
    checked = exact = 0
    while eng.has_unfinished_requests():
        eng.step()
        running = [s for s in eng.scheduler.running if not s.in_prefill]
        summary = eng.batch_choice.summary
        if summary is None or not running:
            continue
        if summary.key != (eng.scheduler.version, len(running)):
            continue  # the batch changed: the next step reads it afresh
        true_lag, true_left, true_sampled = summarize(running, eng.budget.depth)
        assert summary.left == pytest.approx(true_left) and summary.sampled == true_sampled
        assert true_lag <= summary.lag <= true_lag + slack * len(running)
        if summary.exact:
            assert summary.lag == true_lag
            exact += 1
        checked += 1
    assert checked >= 20 and exact >= SUMMARY_REFRESH // 2


def test_hidden_rows_out_of_order_are_refused() -> None:
    """The MTP queue of a sequence takes rows in hidden-index order only and gives them back in
    that order."""
    from engine.sequence import Sequence

    seq = Sequence("r", [1, 2, 3], SamplingParams(), None, num_mtp_modules=2)
    batch = torch.arange(12.0).view(3, 4)  # [3, H=4]: three sequences' rows of one step
    seq.push_hidden(0, 0, torch.zeros(2, 4))
    seq.push_hidden(0, 2, batch[1:2])
    seq.push_hidden(0, 3, batch[:2])
    with pytest.raises(AssertionError, match="out of order"):
        seq.push_hidden(0, 7, batch[:1])
    rows = seq.hidden_rows(0)
    assert rows is not None and rows.shape == (5, 4)
    assert torch.equal(rows[2], batch[1]) and torch.equal(rows[3:], batch[:2])
    seq.push_hidden(0, 5, batch[2:])  # after a read, appending goes on where it stopped
    assert torch.equal(seq.hidden_rows(0)[5], batch[2])  # type: ignore[index]


def test_each_step_reports_the_draft_budget_its_decode_ran_with(small_vocab_dir: Path) -> None:
    """``last_decode_budget`` (what the metrics count per budget): None for a step that only
    prefilled, the budget's label for a decode."""
    from engine.spec.adaptive import budget_label

    for method in ("none", "tree"):
        eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method))
        eng.add_request("r", [1, 2, 3, 4, 5, 0, 1], SamplingParams(max_tokens=6, temperature=0.0))
        seen = []
        while eng.has_unfinished_requests():
            eng.step()
            seen.append(eng.last_decode_budget)
        assert seen[0] is None  # the prefill step decoded nothing
        assert set(seen[1:]) == {budget_label(eng.budget)}, seen


def test_adaptive_engine_reports_each_finished_sequences_relative_yield(small_vocab_dir: Path) -> None:
    """A finished sequence's tokens per drafting step against the arm's mean yield over the
    same steps, its last (cut) step left out, reach the controller's spread; recomputed here
    from the outputs of every step and the mean yield after each."""
    from engine.spec.drain import MIN_DRAFT_STEPS, PRIOR_STEPS

    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    chain = eng._chain_budgets[False][0]
    eng.adaptive.choose = lambda *a, **k: chain  # type: ignore[method-assign]
    for i, n in enumerate((20, 33, 41, 9)):
        eng.add_request(f"r{i}", [i, 1, 2, 3, 4], SamplingParams(max_tokens=n, temperature=0.0))
    per_request: dict[str, list[tuple[int, float]]] = {}  # (tokens, mean yield) per drafting step
    expected_samples = []
    while eng.has_unfinished_requests():
        outs = eng.step()
        mean = eng.adaptive.arms.mean_yield(False, chain)
        for out in outs:
            if out.step_drafted:
                per_request.setdefault(out.request_id, []).append((out.step_accepted + 1, mean))
            if out.finished:
                steps = per_request.get(out.request_id, [])[:-1]
                if len(steps) >= MIN_DRAFT_STEPS:
                    tokens = sum(t for t, _ in steps)
                    expected = sum(m for _, m in steps)
                    prior = PRIOR_STEPS * expected / len(steps)
                    expected_samples.append((tokens + prior) / (expected + prior))
    assert len(expected_samples) >= 3
    assert sorted(eng.adaptive.arms.spread._samples) == pytest.approx(sorted(expected_samples))


def test_adaptive_snapshot_carries_the_spread_once_enough_sequences_finished(small_vocab_dir: Path) -> None:
    """``acceptance_snapshot`` (the server's /admin/acceptance) adds the spread of relative yields
    when it is known; the simulator reads the snapshot as stats either way."""
    from engine.simulator import AcceptanceStats
    from engine.spec.drain import MIN_SPREAD, QUANTILES

    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    chain = eng._chain_budgets[False][0]
    eng.adaptive.choose = lambda *a, **k: chain  # type: ignore[method-assign]  # drafts: counters
    eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=12, temperature=0.0))
    assert "relative_yields" not in eng.acceptance_snapshot()
    for i in range(MIN_SPREAD):
        eng.adaptive.arms.observe_finished(20.0 + i, 20.0, 8)
    snapshot = eng.acceptance_snapshot()
    yields = snapshot["relative_yields"]
    assert isinstance(yields, list) and len(yields) == QUANTILES and yields == sorted(yields)
    AcceptanceStats.from_dict(snapshot)


def test_adaptive_construction_may_wait_for_the_device(
    small_vocab_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up catch-up calibration times the device, so every attribute ``wait_for_device``
    reads exists before it runs (on CUDA a missing one made every adaptive engine fail to
    build; a CPU engine never reaches that branch, so the calibration itself checks here)."""
    import engine.llm_engine as llm_engine

    calibrate = llm_engine.calibrate_catch_up
    waited: list[bool] = []

    def calibrate_after_a_wait(eng: LLMEngine, *args: object, **kwargs: object) -> object:
        eng.wait_for_device()
        waited.append(eng._stream is None)  # read by the CUDA branch
        return calibrate(eng, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm_engine, "calibrate_catch_up", calibrate_after_a_wait)
    LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert waited == [True]


@pytest.mark.parametrize("graphed", [False, True], ids=["host-path", "graphed"])
def test_adaptive_waits_for_the_device_only_after_host_driven_drafting(small_vocab_dir: Path, graphed: bool) -> None:
    """Autoregressive and graphed steps end on a read of their last device result, so their
    step time needs no extra wait (the baseline does none); a host-driven speculative step
    leaves its KV compaction queued and is waited for (and a catch-up is timed alone)."""
    config = EngineConfig(cuda_graphs=True) if graphed else EngineConfig()
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=config)
    assert eng.adaptive is not None
    picks = iter([NO_SPEC] * 3 + [eng.budget] * 100)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    waits: list[str | None] = []
    wait = eng.wait_for_device

    def counted() -> None:
        waits.append(eng.last_decode_budget)
        wait()

    eng.wait_for_device = counted  # type: ignore[method-assign]
    eng.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill
    waits.clear()
    for _ in range(3):  # autoregressive steps
        eng.step()
    assert waits == []
    eng.step()  # the first drafting step catches the MTP modules up (timed alone: a wait)
    waits.clear()
    eng.step()  # steady drafting: the host path waits after its step; the graphed one never
    assert bool(waits) != graphed, waits


@pytest.mark.parametrize("graphed", [False, True], ids=["host-path", "graphed"])
def test_a_drafting_step_after_autoregressive_ones_times_its_catch_up_alone(small_vocab_dir: Path, graphed: bool) -> None:
    """The first drafting step after autoregressive steps catches the MTP modules up first, timed
    alone (what a switch costs), and the rest of it is a steady step of its arm, on both paths.
    (The host path had counted such a step whole as a switch's cost: with new requests joining
    all the time, as in CPU serving, its drafting arms were never measured and were re-run every
    few steps, each run catching up first: 0.74-0.89x of no speculation, session 30.)"""
    config = EngineConfig(cuda_graphs=True) if graphed else EngineConfig()
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=config)
    assert eng.adaptive is not None
    plan = [NO_SPEC] * 4  # four autoregressive steps, then drafting
    eng.adaptive.choose = lambda *a, **k: plan.pop(0) if plan else eng.budget  # type: ignore[method-assign]
    observed: list[tuple[int, str]] = []
    caught_up: list[tuple[int, str, int, bool]] = []
    observe, observe_catch_up = eng.adaptive.observe, eng.adaptive.observe_catch_up

    def noted(batch_size: int, budget: TreeBudget, *args: object, **kwargs: object) -> None:
        observed.append((batch_size, budget_label(budget)))
        observe(batch_size, budget, *args, **kwargs)  # type: ignore[arg-type]

    def noted_catch_up(batch_size: int, budget: TreeBudget, seconds: float, lag_rows: int,
                       sampled: bool = False, timed_alone: bool = False) -> None:
        caught_up.append((batch_size, budget_label(budget), lag_rows, timed_alone))
        observe_catch_up(batch_size, budget, seconds, lag_rows, sampled, timed_alone)

    eng.adaptive.observe = noted  # type: ignore[method-assign]
    eng.adaptive.observe_catch_up = noted_catch_up  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    eng.add_request("a", [1, 2, 3, 4, 5], sp)
    eng.step()  # the prefill (the prompt left to the first drafting step)
    for _ in range(4):
        eng.step()
    assert [b for _, b in observed] == ["none"] * 4 and caught_up == []
    observed.clear()
    eng.step()  # the switch: catch-up timed alone, then a steady drafting step
    label = budget_label(eng.budget)
    assert len(caught_up) == 1 and caught_up[0][:2] == (1, label) and caught_up[0][3], caught_up
    assert caught_up[0][2] > 0  # the rows it was behind
    assert observed == [(1, label)]
    got = None
    while eng.has_unfinished_requests():
        got = next((o.token_ids for o in eng.step() if o.finished), got)
    want = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate([[1, 2, 3, 4, 5]], sp)
    assert got == want[0].token_ids  # lossless all the same


@pytest.mark.parametrize("graphed", [False, True], ids=["host-path", "graphed"])
def test_a_drafting_step_next_to_a_prefill_neither_waits_nor_counts_as_steady(small_vocab_dir: Path, graphed: bool) -> None:
    """A decode step that shares its engine step with a prefill is not timed alone: that would
    make the device idle while the host builds it (the prefill's work waited for first), and
    its batch grows, so it is no steady step's cost. The whole engine step is timed instead, as
    a filling step of its arm; the steps without a prefill are steady."""
    config = EngineConfig(cuda_graphs=True) if graphed else EngineConfig()
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=config)
    assert eng.adaptive is not None
    eng.adaptive.choose = lambda *a, **k: eng.budget  # type: ignore[method-assign]
    waits: list[str | None] = []
    observed: list[int] = []
    filling: list[tuple[int, str, float, int]] = []
    wait, observe, observe_filling = eng.wait_for_device, eng.adaptive.observe, eng.adaptive.observe_filling

    def counted() -> None:
        waits.append(eng.last_decode_budget)
        wait()

    def noted(batch_size: int, *args: object, **kwargs: object) -> None:
        observed.append(batch_size)
        observe(batch_size, *args, **kwargs)  # type: ignore[arg-type]

    def noted_filling(batch_size: int, budget: TreeBudget, seconds: float, tokens: int, sampled: bool = False) -> None:
        filling.append((batch_size, budget_label(budget), seconds, tokens))
        observe_filling(batch_size, budget, seconds, tokens, sampled)

    eng.wait_for_device = counted  # type: ignore[method-assign]
    eng.adaptive.observe = noted  # type: ignore[method-assign]
    eng.adaptive.observe_filling = noted_filling  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng.add_request("a", [1, 2, 3, 4, 5], sp)
    for _ in range(3):  # the prefill, a catch-up and a steady drafting step
        eng.step()
    eng.add_request("b", [3, 4, 5, 1], sp)
    waits.clear()
    observed.clear()
    filling.clear()
    outs = eng.step()  # "b" prefilled, "a" drafts next to it
    assert eng.last_decode_budget == budget_label(eng.budget)
    assert {o.request_id for o in outs} == {"a", "b"}
    assert waits == [] and observed == []
    assert len(filling) == 1 and filling[0][:2] == (1, budget_label(eng.budget))
    assert filling[0][2] > 0 and filling[0][3] == len(next(o for o in outs if o.request_id == "a").new_token_ids)
    [(sampled, arm, cost)] = eng.adaptive.arms.fill_cost_table()
    assert (sampled, arm, cost.rows, cost.count) == (False, eng.budget, 1.0, 1)
    reported = eng.acceptance_snapshot()["fill_costs"]
    assert [(c["batch_size"], c["arm"], c["steps"]) for c in reported] == [  # type: ignore[union-attr]
        (1.0, budget_label(eng.budget), 1)]
    eng.step()  # both decode, nothing prefilled: timed
    assert observed == [2] and len(filling) == 1
    # Lossless all the same: the tokens are autoregressive decoding's.
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        got.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    ar = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    want = ar.generate([[1, 2, 3, 4, 5], [3, 4, 5, 1]], sp)
    assert [got["a"], got["b"]] == [w.token_ids for w in want]


def test_a_batch_counts_as_closed_when_the_caller_says_so_or_nothing_joined_for_a_while(
    small_vocab_dir: Path,
) -> None:
    """Adaptive speculation charges drafting for a batch's drain only when the batch only
    shrinks: in ``generate`` (an offline batch) from its first decode step; when requests are
    added and stepped by hand (a server) only after ``QUIET_STEPS_FOR_CLOSED`` steps without a
    new request, and never while one is being prefilled."""
    from engine.llm_engine import QUIET_STEPS_FOR_CLOSED

    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    seen: list[bool] = []
    eng.adaptive.choose = lambda *a, **k: (seen.append(a[-1]), NO_SPEC)[1]  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=QUIET_STEPS_FOR_CLOSED + 8, temperature=0.0, ignore_eos=True)
    eng.generate([[1, 2, 3], [2, 3, 4]], sp)
    assert seen and all(seen)
    assert not eng.closed_workload
    seen.clear()
    eng.add_request("a", [1, 2, 3], sp)
    eng.step()  # prefill
    for _ in range(QUIET_STEPS_FOR_CLOSED + 4):
        eng.step()
    assert not any(seen[: QUIET_STEPS_FOR_CLOSED - 2]) and all(seen[QUIET_STEPS_FOR_CLOSED:])
    seen.clear()
    eng.add_request("b", [4, 5], sp)  # a newcomer: open again
    eng.step()
    eng.step()
    assert seen == [False, False]


def test_host_path_adaptive_engines_calibrate_their_latency_model_at_start_up(small_vocab_dir: Path) -> None:
    """The host path plans its tree with a latency model timed on the device: at construction,
    not inside the first request; an engine with captured steps never plans and skips it."""
    host = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert host.adaptive is not None and host.adaptive.latency is not None
    graphed = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"),
                                        engine_config=EngineConfig(cuda_graphs=True))  # fmt: skip
    assert graphed.adaptive is not None and graphed.adaptive.latency is None


@pytest.mark.parametrize("others_in_prefill", [True, False])
def test_a_prefill_catches_up_only_a_request_arriving_alone_at_a_drafting_batch(
    small_vocab_dir: Path, others_in_prefill: bool,
) -> None:
    """After a drafting step, a request that arrives alone has its MTP modules caught up in its
    prefill (its first decode step can draft at once). A batch admitted together fills over
    several prefill chunks: its first chunk is not caught up while the others are still in
    prefill (each would need its own catch-up, and the full batch may decode autoregressively)."""
    from engine import EngineConfig

    config = EngineConfig(cuda_graphs=True, prefill_chunk_tokens=8)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=config)
    assert eng.drafter is not None
    eng.add_request("running", [3, 1, 2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    eng.step()  # its prefill
    eng.step()  # its first decode step: the batch decodes
    eng._last_drafting = eng.budget  # and drafted
    caught: list[int] = []
    catch_up = eng.drafter.catch_up
    eng.drafter.catch_up = lambda seqs: caught.append(len(seqs)) or catch_up(seqs)  # type: ignore[method-assign]
    prompts = [[5, 1, 4, 2, 3, 0, 2, 1]] * (3 if others_in_prefill else 1)  # one chunk each
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()  # the first chunk: the first new request's whole prompt
    assert caught == ([] if others_in_prefill else [1])


def _filling_engine(small_vocab_dir: Path, drafts_once_full: bool) -> tuple[LLMEngine, list[int]]:
    """An adaptive engine prefilling 24 prompt tokens per step whose step costs say a batch of
    up to 3 drafts (or decodes autoregressively), and the sizes of its MTP catch-ups."""
    from engine import EngineConfig
    from engine.spec.adaptive import NO_SPEC

    config = EngineConfig(cuda_graphs=True, prefill_chunk_tokens=24)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=config)
    assert eng.drafter is not None and eng.adaptive is not None
    arms = eng.graphed_budgets(False)
    assert arms
    eng.adaptive.arms.catch_up.calibrate([(8, 0.0005), (64, 0.001)])
    for bucket in (1, 2):  # batches of 1 and of 2-3
        eng.adaptive.arms.seed_cost(bucket, False, NO_SPEC, 0.010)
        for arm in arms:  # per token far below (or above) an autoregressive step
            eng.adaptive.arms.seed_cost(bucket, False, arm, 0.001 if drafts_once_full else 0.100)
    caught: list[int] = []
    catch_up = eng.drafter.catch_up
    eng.drafter.catch_up = lambda seqs: caught.append(len(seqs)) or catch_up(seqs)  # type: ignore[method-assign]
    return eng, caught


@pytest.mark.parametrize("drafts_once_full", [True, False])
def test_the_last_chunk_of_a_filling_batch_follows_the_batch_not_the_last_one(
    small_vocab_dir: Path, drafts_once_full: bool,
) -> None:
    """A batch admitted together whose last chunk is prefilled before any of it has decoded
    (two chunks: a prefill-only step, then the last): that chunk is caught up as the filled
    batch would draft, not as the previous batch's last decode step had (the H200's batch
    128 left its second chunk to its first drafting step whenever the batch before it had
    ended decoding autoregressively)."""
    eng, caught = _filling_engine(small_vocab_dir, drafts_once_full)
    eng._last_drafting = None if drafts_once_full else eng.budget  # the previous batch's last step
    for i in range(2):
        eng.add_request(f"r{i}", [5, 1, 4, 2, 3, 0, 2, 1] * 3, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()  # the first chunk alone
    eng.step()  # the last chunk, then the first request's first decode step
    assert caught == ([1, 1] if drafts_once_full else [])


@pytest.mark.parametrize("drafts_once_full", [True, False])
def test_a_filling_batch_that_will_draft_is_caught_up_chunk_by_chunk(
    small_vocab_dir: Path, drafts_once_full: bool,
) -> None:
    """A batch admitted together fills over several prefill chunks. Where the batch it becomes
    would switch to drafting, its catch-up over every prompt counted (the step costs known for
    its size say so), each chunk's prompts are caught up in their prefill, so the drafting step
    after the fill has nothing to catch up; where it would decode autoregressively, none is."""
    from engine.spec.adaptive import NO_SPEC

    eng, caught = _filling_engine(small_vocab_dir, drafts_once_full)
    assert eng.adaptive is not None
    # One chunk each, longer than a steady step's catch-up rows (shorter prompts need none).
    for i in range(3):
        eng.add_request(f"r{i}", [5, 1, 4, 2, 3, 0, 2, 1] * 3, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    eng.step()  # the first chunk: the first request's whole prompt, two others still to come
    assert caught == ([1] if drafts_once_full else [])
    # Drafting during and after the fill gives the autoregressive tokens.
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(
        [[5, 1, 4, 2, 3, 0, 2, 1] * 3], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert all(final[f"r{i}"] == base[0].token_ids for i in range(3))
    if drafts_once_full:
        assert set(eng.adaptive.steps_per_arm) - {NO_SPEC}, "it drafted"


def test_a_fill_whose_first_chunks_were_caught_up_catches_up_its_last(small_vocab_dir: Path) -> None:
    """Once a chunk of a fill was caught up for the batch it becomes, so is every later chunk
    of that fill, even where the last decode step ran autoregressively and the question would
    now be answered no: the H200's batch 256 left its last chunk ("alone", after an
    autoregressive filling step) to the first full step, which took 22 ms against ~6. A step
    without a prefill ends the fill: a later request is asked afresh."""
    eng, _ = _filling_engine(small_vocab_dir, drafts_once_full=True)
    assert eng.drafter is not None
    caught: list[list[str]] = []
    catch_up = eng.drafter.catch_up
    eng.drafter.catch_up = lambda seqs: caught.append([s.request_id for s in seqs]) or catch_up(seqs)  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(3):  # one chunk each
        eng.add_request(f"r{i}", [5, 1, 4, 2, 3, 0, 2, 1] * 3, sp)
    eng.step()  # r0's prefill: the filled batch would draft
    assert caught == [["r0"]]
    eng.step()  # r1's, and r0's first decode step
    assert ["r1"] in caught
    eng._last_drafting = None  # as if that step had decoded autoregressively
    eng.batch_choice.filled_batch_drafts = lambda: None  # type: ignore[method-assign]  # and the question now said no
    eng.step()  # r2's, the fill's last chunk ("alone": nothing waits, the batch has decoded)
    assert ["r2"] in caught
    while eng.has_unfinished_requests():
        eng.step()
    caught.clear()
    eng.add_request("late", [5, 1, 4, 2, 3, 0, 2, 1] * 3, sp)
    eng.step()  # a new fill: asked afresh, and the answer is still no
    assert caught == []


def test_an_adaptive_engine_serves_a_request_its_first_token_ends(small_vocab_dir: Path) -> None:
    """The prefill's first token ends the only request (max_tokens 1): the batch the prefill
    would catch up for is empty (it had divided by zero)."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"),
                                    engine_config=EngineConfig(cuda_graphs=True))  # fmt: skip
    out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 1 and out[0].finish_reason == "length"


@pytest.mark.parametrize(("batch", "temperature", "latched"), [(64, 0.0, True), (64, 0.7, True), (8, 0.0, False)])
def test_a_large_closed_batch_decoding_autoregressively_latches_its_choice(
    small_vocab_dir: Path, batch: int, temperature: float, latched: bool
) -> None:
    """Drafting measured dear at every batch size: a closed batch of 64 behind its MTP modules
    (its prompts never caught up) decodes autoregressively, and after its first decode step no
    choice is made until the batch changes: no batch summary, no choice, only the step's
    measurement (without it, the autoregressive cost was left to the dear steps around a batch
    change, and the H200's batches of 64-256 drafted where they lost: session 33). A batch of 8
    keeps choosing at every step. Greedy, the tokens are the baseline's, and every step is
    counted as autoregressive."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    controller = eng.adaptive
    assert controller is not None
    tree, chain = controller._planned_tree(eng), controller.chain
    for size in (1, 8, 64):
        for _ in range(5):
            for sampled in (False, True):
                controller.observe(size, NO_SPEC, 0.001 * size, size, sampled)
                for arm in (tree, chain):
                    controller.observe(size, arm, 0.1 * size, 2 * size, sampled)
    choices, observed = 0, 0
    choose, observe = controller.arms.choose, controller.arms.observe

    def counting_choose(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal choices
        choices += 1
        return choose(*args, **kwargs)

    def counting_observe(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal observed
        observed += 1
        return observe(*args, **kwargs)

    controller.arms.choose, controller.arms.observe = counting_choose, counting_observe  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(batch)
    vocab = eng.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (12,), generator=gen).tolist() for _ in range(batch)]
    # Unseeded: adaptive speculation decodes seeded sampled requests autoregressively without
    # a choice (``test_seeded_sampling_is_reproducible_under_adaptive_speculation``).
    sp = SamplingParams(max_tokens=10, temperature=temperature, ignore_eos=True)
    outs = eng.generate(prompts, sp)
    if temperature == 0.0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in base.generate(prompts, sp)]
    decode_steps = sum(controller.steps_per_arm.values())
    assert controller.steps_per_arm[NO_SPEC] == decode_steps >= 9  # the prefill made token 1
    if latched:
        # The filling step (the 64 prompts prefill in two chunks), the full batch's first
        # decode step (it latches), and the last step of the second chunk's 22 sequences (the
        # first chunk's 42, a token ahead, have finished): 3 choices in 10 steps.
        assert choices <= 3, choices
    else:
        assert choices == decode_steps, choices
    assert observed >= decode_steps - 1  # every step without a prefill is measured
