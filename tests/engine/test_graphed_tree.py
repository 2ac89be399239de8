"""The graphed greedy tree step (engine/spec/graphed_tree.py), run eagerly on CPU.

It must give the autoregressive tokens, draft the same trees as the host-driven drafter (same
MTP state, same acceptance), leave no draft KV behind, and hand sequences it cannot take
(sampling, fresh prompts) to the host path in the same step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.outputs import RequestOutput
from engine.sequence import Sequence
from engine.spec.graphed_tree import GraphedTreeStep

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 0, 1], [2, 3, 1, 4, 0], [4] * 20, [5, 1, 2, 2, 3, 1]]
STATIC = EngineConfig(cuda_graphs=True)  # the CUDA-graph code path, eager on CPU
SPECS = [
    SpecConfig(method="tree", topk=4, depth=6, num_draft_tokens=32),  # the GPU default shape
    SpecConfig(method="tree", topk=3, depth=4, num_draft_tokens=9),
    SpecConfig(method="chain", num_draft_tokens=5),
    SpecConfig(method="tree", topk=2, depth=2, num_draft_tokens=4, reuse_last_module=False),
]


def _engine(folder: Path, spec: SpecConfig, cfg: EngineConfig = STATIC) -> tuple[LLMEngine, list[int]]:
    eng = LLMEngine.from_pretrained(folder, spec=spec, engine_config=cfg)
    calls: list[int] = []
    if eng.graphed_tree is not None:
        run = eng.graphed_tree.run
        eng.graphed_tree.run = lambda seqs, *a: calls.append(len(seqs)) or run(seqs, *a)  # type: ignore[method-assign]
    return eng, calls


def _serve(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every request at once and step the engine until all finished; final outputs by id."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    return final


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-{s.topk}-{s.depth}-{s.num_draft_tokens}")
def test_graphed_greedy_equals_autoregressive(small_vocab_dir: Path, spec: SpecConfig) -> None:
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    eng, calls = _engine(small_vocab_dir, spec)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    # After the prefill catch-up every decode step of every sequence is graphed.
    assert sum(calls) == sum(o.stats.num_steps for o in outs)
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    assert eng.acceptance_snapshot()["num_steps"] == sum(calls)


@pytest.mark.parametrize("early", [True, False], ids=["early-catch-up", "late-catch-up"])
def test_the_prefill_catch_up_before_or_after_the_first_tokens_changes_no_output(
    small_vocab_dir: Path, early: bool
) -> None:
    """``EngineConfig.early_catch_up``: queued before the first tokens are drawn, the prompt's
    catch-up stops one row short (the first drafting step takes that row with its own); either
    way every decode step is graphed and the tokens are autoregressive decoding's."""
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    eng, calls = _engine(small_vocab_dir, SPECS[0], EngineConfig(cuda_graphs=True, early_catch_up=early))
    caught: list[list[int]] = []  # prompt rows module 1 has left after each prefill catch-up
    catch_up = eng.drafter.catch_up  # type: ignore[union-attr]

    def traced(seqs: list[Sequence]) -> list[Sequence]:
        rest = catch_up(seqs)
        caught.append([s.output_start - s.mtp_committed[0] for s in seqs])
        return rest

    eng.drafter.catch_up = traced  # type: ignore[method-assign, union-attr]
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert sum(calls) == sum(o.stats.num_steps for o in outs)
    # Module 1's row t consumes token t + 1: the prompt's last row waits for the first token,
    # and early, before it is drawn, the row before it too (its token was then the last one).
    assert caught and all(left == (2 if early else 1) for left in caught[0]), caught


def test_graphed_moe_equals_autoregressive(small_vocab_moe_dir: Path) -> None:
    base = LLMEngine.from_pretrained(small_vocab_moe_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    eng, calls = _engine(small_vocab_moe_dir, SpecConfig(method="tree", topk=3, depth=5, num_draft_tokens=12))
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert calls


def test_graphed_drafts_the_host_drafters_trees(small_vocab_dir: Path) -> None:
    """Same full trees (no confidence cut) -> the same accepted tokens at every step."""
    spec = SpecConfig(method="tree", topk=3, depth=5, num_draft_tokens=12, min_path_prob=0.0)
    host = LLMEngine.from_pretrained(small_vocab_dir, spec=spec).generate(PROMPTS, GREEDY)
    eng, calls = _engine(small_vocab_dir, spec)
    graphed = eng.generate(PROMPTS, GREEDY)
    assert calls
    for h, g in zip(host, graphed, strict=True):
        assert g.stats.num_steps == h.stats.num_steps
        assert g.stats.accepted_per_position == h.stats.accepted_per_position


def test_graphed_session_kv_equals_autoregressive_and_nothing_else_remains(small_vocab_dir: Path) -> None:
    """Committed target KV equals the AR run's; every slot past the committed entries is zero
    in every layer (rejected drafts, frontier and padding rows leave nothing)."""
    caches = []
    for spec in (SpecConfig(method="none"), SpecConfig(method="tree", topk=3, depth=5, num_draft_tokens=12)):
        eng, _ = _engine(small_vocab_dir, spec)
        eng.open_session("s")
        eng.add_request("r", [1, 2, 3, 4, 5, 0, 1], GREEDY, session_id="s")
        while eng.has_unfinished_requests():
            eng.step()
        seq = eng._sessions["s"]
        bs = eng.pool.block_size
        flat = eng.pool.kv_cache.view(eng.pool.kv_cache.shape[0], -1, eng.pool.kv_cache.shape[-1])
        slots = torch.tensor([seq.block_ids[p // bs] * bs + p % bs for p in range(len(seq.block_ids) * bs)])
        main = eng.model_config.num_hidden_layers
        committed = flat[:main, slots[: seq.num_committed]]
        assert torch.count_nonzero(flat[:main, slots[seq.num_committed :]]) == 0
        for d, done in enumerate(seq.mtp_committed):
            assert torch.count_nonzero(flat[main + d, slots[done:]]) == 0, f"MTP module {d + 1}"
        caches.append((seq.num_committed, committed))
    (n_ar, ar), (n_tree, tree) = caches
    assert n_ar == n_tree
    torch.testing.assert_close(tree, ar, rtol=1e-4, atol=1e-5)


def test_mixed_batch_greedy_graphed_sampled_on_host(small_vocab_dir: Path) -> None:
    spec = SpecConfig(method="tree", topk=3, depth=4, num_draft_tokens=9)
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS[:2], GREEDY)
    eng, calls = _engine(small_vocab_dir, spec)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    final = _serve(eng, {"g0": (PROMPTS[0], GREEDY), "s0": (PROMPTS[2], sampled), "g1": (PROMPTS[1], GREEDY)})
    assert final["g0"].token_ids == base[0].token_ids
    assert final["g1"].token_ids == base[1].token_ids
    assert len(final["s0"].token_ids) == 40
    assert calls and max(calls) == 2, "only the greedy sequences take the graphed step"
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)


def test_graphed_step_is_off_without_static_path(small_vocab_dir: Path) -> None:
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"))
    assert eng.graphed_tree is None  # CPU default: host-driven path
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"), engine_config=STATIC)
    assert eng.graphed_tree is None  # nothing to draft


def test_autoregressive_steps_in_between_keep_the_graphed_path_exact(small_vocab_dir: Path) -> None:
    """Adaptive speculation mixes AR and graphed steps: one or two AR steps fit the catch-up
    slack, longer AR runs get an eager MTP catch-up first; tokens stay the AR tokens."""
    from engine.spec.drafter import TreeBudget

    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    eng, calls = _engine(small_vocab_dir, SpecConfig(method="tree", topk=3, depth=4, num_draft_tokens=9))
    pattern = [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]  # 1 = speculate
    no_spec = TreeBudget(topk=1, depth=0, num_draft_tokens=0)
    step = iter(range(10**6))
    eng.batch_choice.choose = lambda seqs, filling=False, closed=False: (  # type: ignore[method-assign]
        eng.budget if pattern[next(step) % len(pattern)] else no_spec, 0, False
    )
    caught_up = []
    catch_up = eng.drafter.catch_up  # type: ignore[union-attr]
    eng.drafter.catch_up = lambda seqs: caught_up.append(len(seqs)) or catch_up(seqs)  # type: ignore[union-attr,method-assign]
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert calls, "speculative steps should take the graphed path"
    assert len(caught_up) > 1, "long AR runs need a catch-up before the graphed step"


def test_graphed_stop_inside_path_and_second_session_turn(small_vocab_dir: Path) -> None:
    """A stop token met inside an accepted path ends the output there; a session's next turn
    (prefill on top of the kept KV and MTP state) still decodes exactly like AR."""
    spec = SpecConfig(method="tree", topk=3, depth=5, num_draft_tokens=12)
    runs = []
    for s in (SpecConfig(method="none"), spec):
        eng, calls = _engine(small_vocab_dir, s)
        base = eng.generate([PROMPTS[2]], GREEDY)[0].token_ids
        stop = base[7]
        sp = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))
        stopped = eng.generate([PROMPTS[2]], sp)[0]
        eng.open_session("s")
        turns = []
        for prompt in ([1, 2, 3, 4, 5], [0, 1, 2]):
            eng.add_request(f"turn-{len(turns)}", prompt, GREEDY, session_id="s")
            final = None
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        final = o
            assert final is not None
            turns.append(final.token_ids)
        runs.append((stopped.token_ids, stopped.finish_reason, turns, len(calls)))
    (ar_stop, ar_reason, ar_turns, _), (g_stop, g_reason, g_turns, g_calls) = runs
    assert (g_stop, g_reason) == (ar_stop, ar_reason) and g_stop[-1] == stop
    assert g_turns == ar_turns
    assert g_calls > 0


def test_a_request_ending_inside_a_path_is_zeroed_with_its_blocks(small_vocab_dir: Path) -> None:
    """Requests whose max_tokens cut an accepted path: nothing is zeroed for the cut itself (their
    blocks are zeroed whole when the step ends); a session's turn cut the same way zeroes the
    entries past its last token at once, since it keeps its blocks for the next turn."""
    eng, _ = _engine(small_vocab_dir, SPECS[1])
    truncated: list[tuple[bool, int]] = []  # (keeps its blocks, slot fills during the cut)
    fills: list[int] = []
    zero_slots, truncate = eng.pool.zero_slots, eng._truncate_committed
    eng.pool.zero_slots = lambda slots, layers=None: fills.append(len(slots)) or zero_slots(slots, layers)  # type: ignore[method-assign]

    def traced(seq: Sequence) -> None:
        before = len(fills)
        truncate(seq)
        truncated.append((eng._keeps_blocks(seq), len(fills) - before))

    eng._truncate_committed = traced  # type: ignore[method-assign]
    lengths = (5, 6, 7, 9, 11)
    scratch = eng.kv_blocks_used  # the graphed steps' own scratch blocks
    requests = {f"r{n}": (PROMPTS[2], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for n in lengths}
    outs = _serve(eng, requests)
    assert [len(outs[f"r{n}"].token_ids) for n in lengths] == list(lengths)
    assert truncated and all(cut == 0 for keeps, cut in truncated if not keeps)
    assert torch.count_nonzero(eng.pool.kv_cache) == 0 and eng.kv_blocks_used == scratch
    eng.open_session("s")
    for n in range(3, 30):  # turns until one ends inside a path
        eng.add_request(f"turn-{n}", PROMPTS[n % len(PROMPTS)],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), session_id="s")  # fmt: skip
        while eng.has_unfinished_requests():
            eng.step()
        if any(keeps for keeps, _ in truncated):
            break
    assert any(keeps and cut > 0 for keeps, cut in truncated), truncated


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: f"{s.method}-{s.topk}-{s.depth}-{s.num_draft_tokens}")
def test_graphed_sampled_step_at_low_temperature_follows_greedy(small_vocab_dir: Path, spec: SpecConfig) -> None:
    """The sampled device step (engine/spec/graphed_sampled.py): near temperature 0 both the
    draft and the target laws are point masses, so its tokens are the argmax tokens; all its
    plumbing (drawn tree, positions, acceptance walk, KV compaction) is exercised."""
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=STATIC)
    runner = eng.graphed_sampled
    assert runner is not None
    calls: list[int] = []
    run = runner.run
    runner.run = lambda seqs, *a: calls.append(len(seqs)) or run(seqs, *a)  # type: ignore[method-assign]
    cold = SamplingParams(max_tokens=40, temperature=1e-5, ignore_eos=True)
    outs = eng.generate(PROMPTS, cold)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert calls and max(calls) == len(PROMPTS)
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache[:, eng.static_scratch_blocks]) == 0


def test_greedy_and_unseeded_sampled_sequences_both_graphed_in_one_step(small_vocab_dir: Path) -> None:
    """A mixed batch runs both device steps in the same engine step; the greedy sequences keep
    the autoregressive tokens and nothing is left in the KV cache afterwards."""
    spec = SpecConfig(method="tree", topk=3, depth=4, num_draft_tokens=9)
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS[:2], GREEDY)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=STATIC)
    steps: list[tuple[str, int]] = []
    for name in ("graphed_tree", "graphed_sampled"):
        runner = getattr(eng, name)
        run = runner.run
        runner.run = lambda seqs, *a, run=run, name=name: steps.append((name, len(seqs))) or run(seqs, *a)
    sampled = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, ignore_eos=True)
    final = _serve(eng, {"g0": (PROMPTS[0], GREEDY), "s0": (PROMPTS[2], sampled),
                         "g1": (PROMPTS[1], GREEDY), "s1": (PROMPTS[3], sampled)})
    assert final["g0"].token_ids == base[0].token_ids
    assert final["g1"].token_ids == base[1].token_ids
    assert len(final["s0"].token_ids) == len(final["s1"].token_ids) == 40
    assert ("graphed_tree", 2) in steps and ("graphed_sampled", 2) in steps
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache[:, eng.static_scratch_blocks]) == 0


def test_a_sampled_batch_goes_to_the_sampled_step_first_and_the_greedy_one_checks_nothing(
    small_vocab_dir: Path,
) -> None:
    """After a graphed step, the step that took it is asked first: a sampled batch is not
    checked sequence by sequence by the greedy step at every engine step, before or after
    some of its requests finished."""
    spec = SpecConfig(method="tree", topk=3, depth=4, num_draft_tokens=9)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=STATIC)
    assert eng.graphed_tree is not None and eng.graphed_sampled is not None
    checked: list[int] = []
    eligible = eng.graphed_tree.eligible
    eng.graphed_tree.eligible = lambda seq: checked.append(1) or eligible(seq)  # type: ignore[method-assign]
    requests = {f"s{i}": (prompt, SamplingParams(max_tokens=12 + 6 * i, temperature=0.9, ignore_eos=True))
                for i, prompt in enumerate(PROMPTS)}  # fmt: skip
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    eng.step()  # the prefill
    eng.step()  # the first graphed step: no step ran before, the greedy one is asked first
    first = len(checked)
    assert first == len(PROMPTS)
    final = _serve(eng, {})
    assert len(checked) == first, "the greedy step checked sequences after the first step"
    assert sorted(len(o.token_ids) for o in final.values()) == [12, 18, 24, 30]


def test_adaptive_switches_between_captured_budgets_and_autoregressive_losslessly(
    small_vocab_dir: Path,
) -> None:
    """Adaptive on the graphed path captures the tree and a chain; stepping through every arm
    in turn (each switch leaves the MTP modules in another state: behind after AR steps, too far
    ahead for the chain's catch-up rows after a tree step) keeps the autoregressive tokens, runs
    both device steps, and leaves nothing behind."""
    from engine.spec.adaptive import NO_SPEC

    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=STATIC)
    arms = eng.graphed_budgets(sampled=False)
    assert len(arms) == 2 and arms[0] == eng.budget and arms[1].topk == 1, arms
    assert len(eng.graphed_budgets(sampled=True)) == 2
    order = [NO_SPEC, arms[1], arms[1], arms[0], arms[0], NO_SPEC, NO_SPEC, arms[0], arms[1]]
    picks = iter(order * 100)
    eng.adaptive.choose = lambda *args, **kwargs: next(picks)  # type: ignore[union-attr, method-assign]
    used: list[int] = []
    for runner in eng._graphed_runners[::2]:  # the greedy steps: tree, chain
        run = runner.run
        runner.run = lambda seqs, *a, run=run, n=runner.N: used.append(n) or run(seqs, *a)  # type: ignore[method-assign]
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert {arms[0].num_draft_tokens, arms[1].num_draft_tokens} <= set(used)
    # Chain steps offer rank 0 only: the ranks past it were offered by the tree's steps alone.
    offered = eng.acceptance_snapshot()["depth_rank_offered"]
    assert offered[0][1] == offered[0][arms[0].topk - 1] > 0  # type: ignore[index]
    assert offered[0][0] > offered[0][1]  # type: ignore[index]
    # Tree steps also tell the chain's yield on the same prompts (its leading rank-0 nodes).
    assert eng.adaptive is not None
    yield_seen = eng.adaptive.arms._yield[(False, arms[1])][1]
    assert yield_seen > eng.adaptive.arms._lifetime[(False, arms[1])][1]
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache[:, eng.static_scratch_blocks]) == 0


def test_steady_steps_load_the_previous_steps_rows_and_match_the_general_load(
    small_vocab_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step over the same sequences as the last, untouched since (``SteadyRows``), loads
    nothing: the last step advanced the bucket's inputs on the device (``_advance``). Those
    inputs must be what the general path loads, on every row it loads, and anything that
    replaced a sequence's rows (a finished request leaving, an autoregressive step in between)
    must send the step down the general path."""
    from engine.spec import graphed_state
    from engine.spec.adaptive import NO_SPEC

    eng, _ = _engine(small_vocab_dir, SPECS[1])
    assert eng.graphed_tree is not None
    runners = eng._graphed_runners
    fast: list[bool] = []
    steady_in: list[str] = []  # the runner of each steady step
    holds = graphed_state.SteadyRows.holds

    def checked_holds(self: graphed_state.SteadyRows, seqs: list) -> bool:  # type: ignore[type-arg]
        ok = holds(self, seqs)
        fast.append(ok)
        if ok:  # the advanced inputs are what the general path would load, on the rows it loads
            g, buf = next((r, b) for r in runners for b in r._buffers.values() if b.steady is self)
            steady_in.append(type(g).__name__)
            _assert_inputs_are_the_batchs(g, buf, seqs)
        return ok

    monkeypatch.setattr(graphed_state.SteadyRows, "holds", checked_holds)
    lengths = (12, 25, 40, 40)
    params = {f"r{i}": (p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
              for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))}  # fmt: skip
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    want = _serve(base, params)
    got = _serve(eng, params)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert fast.count(True) >= 10 and fast.count(False) >= 1, fast  # steady runs, and a request leaving
    # An autoregressive step in between replaces the rows (the hidden log hands them over).
    eng2 = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=STATIC)
    assert eng2.adaptive is not None
    picks = iter([eng2.budget] * 6 + [NO_SPEC] + [eng2.budget] * 200)
    eng2.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    runners = eng2._graphed_runners
    fast.clear()
    got2 = _serve(eng2, params)
    assert {r: o.token_ids for r, o in got2.items()} == {r: o.token_ids for r, o in want.items()}
    assert False in fast[4:8], fast
    # The sampled device step advances its inputs the same way (wrong MTP inputs would change
    # only its drafts, which the sampling-law tests cannot see).
    sampled = {r: (p, SamplingParams(max_tokens=sp.max_tokens, temperature=0.8, ignore_eos=True))
               for r, (p, sp) in params.items()}  # fmt: skip
    runners = eng._graphed_runners
    steady_in.clear()
    got3 = _serve(eng, sampled)
    assert [len(o.token_ids) for o in got3.values()] == list(lengths)
    assert steady_in.count("GraphedSampledTree") >= 5, steady_in


def _assert_inputs_are_the_batchs(g: GraphedTreeStep, buf: Any, seqs: list[Sequence]) -> None:
    """The bucket's inputs are what the general path loads for ``seqs``, row by row (pending
    rows read through ``deferred`` without handing them out), and its padding rows dummies."""
    assert buf.live.tolist() == [i < len(seqs) for i in range(buf.bucket)]
    for i, s in enumerate(seqs):
        L = s.num_committed
        c = L - s.mtp_committed[0]
        assert (int(buf.L[i]), int(buf.c[i])) == (L, c)
        assert buf.tail[i].tolist() == s.tokens[L - c + 1 : L + 1] + [0] * (g.C - c)
        assert buf.tables[i, : len(s.block_ids)].tolist() == s.block_ids
        if s.deferred is not None:
            source, index = s.deferred
            pending = source.hidden_of(index)
        else:
            pending = [s.pending_hidden[d] for d in range(g.k)]
        assert len(pending) == g.k
        assert torch.equal(buf.rows0[i, :c], pending[0])
        for d in range(1, g.k):
            assert torch.equal(buf.carry[i, d - 1 : d], pending[d])
    for i in range(len(seqs), buf.bucket):  # padding rows stay dummies
        assert (int(buf.L[i]), int(buf.c[i]), buf.tail[i].tolist()) == (g.k, 1, [0] * g.C)


def test_default_chain_arms_add_one_as_deep_as_the_modules_for_greedy_batches(tmp_path: Path) -> None:
    """With more MTP modules than ``CHAIN_DEPTH`` the default chain arms of greedy batches are one
    ``CHAIN_DEPTH`` deep (chain-6 alone on six modules was dearer per token at batches 128-256
    on the H200, session 38) and one as deep as the modules (greedy batch 1 at 2.99-3.09x
    against 2.82-2.87x, session 41); sampled batches keep the first only (a sampled chain-6
    yields little more than chain-4 at a dearer step). Adaptive speculation switching between
    them and the tree keeps the autoregressive tokens; the host path keeps one chain."""
    from engine.spec.adaptive import NO_SPEC
    from engine.spec.defaults import CHAIN_DEPTH
    from tests.model_factory import build_checkpoint

    modules = CHAIN_DEPTH + 2
    folder = build_checkpoint(tmp_path / "m6", seed=3, vocab_size=6, num_nextn_predict_layers=modules)
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="adaptive"), engine_config=STATIC)
    assert eng.adaptive is not None
    tree, chain, deep = eng.graphed_budgets(sampled=False)
    assert [(c.topk, c.depth, c.num_draft_tokens) for c in (chain, deep)] == [(1, CHAIN_DEPTH, CHAIN_DEPTH), (1, modules, modules)]
    assert eng.graphed_budgets(sampled=True) == [tree, chain]
    assert eng.adaptive.chain == chain and eng.adaptive.chains_for(True) == [chain]
    picks = iter(([chain] * 3 + [tree] * 2 + [NO_SPEC] + [deep] * 2 + [chain]) * 100)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    want = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
    host = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="adaptive"))
    assert host.adaptive is not None and host.adaptive.chain.depth == CHAIN_DEPTH


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_switch_of_drafting_arm_takes_the_batch_over_on_the_device(
    small_vocab_dir: Path, temperature: float
) -> None:
    """Switching between the captured tree and chain loads nothing from the host: the runner
    switched to takes over the other's advanced inputs (``GraphedTreeStep.adopt``), its
    catch-up rows truncated (tree to chain) or padded (chain to tree), and they are what the
    general path would load. Greedy tokens stay the autoregressive ones; sampled requests run
    their full length."""
    torch.manual_seed(0)  # unseeded sampled requests draw from the global generator
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"), engine_config=STATIC)
    assert eng.adaptive is not None
    tree, chain = eng.graphed_budgets(sampled=temperature > 0)
    picks = iter(([tree] * 2 + [chain] * 2 + [tree] + [chain]) * 100)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    sampled = temperature > 0
    runners = [r for r in eng._graphed_runners if r.serves(SamplingParams(temperature=temperature))]
    assert {r.budget for r in runners} == {tree, chain}
    fresh: list[tuple[int, int]] = []  # (runner depth, sequences loaded from the host)
    adopted: list[int] = []
    for g in runners:
        load, load_inputs, adopt = g._load_fresh, g._load_inputs, g.adopt

        def load_traced(buf: Any, seqs: list[Sequence], *args: Any, g: Any = g, load: Any = load) -> None:
            fresh.append((g.D, len(seqs)))
            load(buf, seqs, *args)

        def load_checked(buf: Any, seqs: list[Sequence], g: Any = g, load_inputs: Any = load_inputs) -> list[int]:
            c = load_inputs(buf, seqs)
            _assert_inputs_are_the_batchs(g, buf, seqs)
            return c

        def adopt_traced(other: Any, seqs: list[Sequence], adopt: Any = adopt) -> list[int] | None:
            rows = adopt(other, seqs)
            adopted.append(0 if rows is None else sum(r >= 0 for r in rows))
            return rows

        g._load_fresh = load_traced  # type: ignore[method-assign]
        g._load_inputs = load_checked  # type: ignore[method-assign]
        g.adopt = adopt_traced  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=30, temperature=temperature, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    got = _serve(eng, requests)
    if not sampled:
        base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
        assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in _serve(base, requests).items()}
    assert [len(o.token_ids) for o in got.values()] == [30] * len(PROMPTS)
    # Only the first drafting step loads the batch from the host; every switch takes over
    # what is left of it.
    assert len(fresh) == 1 and fresh[0][1] == len(PROMPTS), fresh
    assert len(adopted) >= 5 and adopted[0] == len(PROMPTS) and min(adopted) >= 1, adopted
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache[:, eng.static_scratch_blocks]) == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_batch_some_of_whose_requests_finished_is_gathered_on_the_device(
    small_vocab_dir: Path, temperature: float
) -> None:
    """Requests leaving the batch (and one joining) do not send the others through the host
    load: their inputs, advanced by the last step, are gathered on the device into their new
    rows (also into a smaller bucket), the newcomer loaded from the host beside them; the inputs
    are what the general path would load, and greedy tokens the autoregressive ones (the
    sampled step gathers the same way)."""
    eng, _ = _engine(small_vocab_dir, SPECS[1])
    g = eng.graphed_tree if temperature == 0.0 else eng.graphed_sampled
    assert g is not None
    gathered: list[int] = []
    loaded: list[int] = []
    gather, load, load_inputs = g._gather_inputs, g._load_fresh, g._load_inputs

    def gather_traced(src: Any, dst: Any, to: list[int], rows: list[int]) -> None:
        gathered.append(len(to))
        gather(src, dst, to, rows)

    def load_traced(buf: Any, seqs: list[Sequence], *args: Any) -> None:
        loaded.append(len(seqs))
        load(buf, seqs, *args)

    def load_checked(buf: Any, seqs: list[Sequence]) -> list[int]:
        c = load_inputs(buf, seqs)
        _assert_inputs_are_the_batchs(g, buf, seqs)
        return c

    g._gather_inputs = gather_traced  # type: ignore[method-assign]
    g._load_fresh = load_traced  # type: ignore[method-assign]
    g._load_inputs = load_checked  # type: ignore[method-assign]
    lengths = (9, 14, 30, 36, 36)  # five requests: bucket 8, then 4 when two have left
    requests = {f"r{i}": (PROMPTS[i % len(PROMPTS)] + [i % 6],
                          SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True))
                for i, n in enumerate(lengths)}  # fmt: skip
    late = ("late", ([3, 1, 4, 1, 5], SamplingParams(max_tokens=20, temperature=temperature, ignore_eos=True)))
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    want = _serve(base, {**requests, late[0]: late[1]})
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    got: dict[str, RequestOutput] = {}
    steps = 0
    while eng.has_unfinished_requests():
        if steps == 5:  # joins a running batch: loaded from the host beside the gathered rows
            eng.add_request(late[0], *late[1])
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
        steps += 1
    if temperature == 0.0:
        assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert {r: len(o.token_ids) for r, o in got.items()} == {r: len(o.token_ids) for r, o in want.items()}
    assert gathered and any(n < len(lengths) for n in gathered), gathered
    assert any(n == 1 for n in loaded), f"the late request alone loaded from the host: {loaded}"


@pytest.mark.parametrize("method", ["none", "tree", "adaptive"])
def test_static_paths_build_and_decode_with_a_short_context(small_vocab_dir: Path, method: str) -> None:
    """A context shorter than the largest captured prefill and catch-up shapes (their padding
    would not fit a block table): those shapes are left out, the start-up calibrations stay
    within the context, and greedy output is autoregressive decoding's."""
    config = EngineConfig(cuda_graphs=True, calibrate_arms=True, max_batch_size=2, max_model_len=48)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method), engine_config=config)
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    prompts = [PROMPTS[0], PROMPTS[2]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in base.generate(prompts, params)]
    assert eng.kv_blocks_used == len(set(eng.static_scratch_blocks))


def test_the_drafting_layer_drafts_the_layer_paths_trees(small_vocab_lora_dir: Path) -> None:
    """The MTP modules' drafting forward (absorbed weights, fused GEMMs: on CPU their PyTorch
    form) computes the layer path's function: in float32 the same trees, so the same accepted
    tokens at every step, and the autoregressive output."""
    spec = SPECS[0]
    base = LLMEngine.from_pretrained(small_vocab_lora_dir, spec=SpecConfig(method="none")).generate(PROMPTS, GREEDY)
    layer_path, _ = _engine(small_vocab_lora_dir, spec)
    assert layer_path.graphed_tree is not None and not layer_path.graphed_tree.draft_layers
    eng, calls = _engine(small_vocab_lora_dir, spec, EngineConfig(cuda_graphs=True, drafting_layer=True))
    runner = eng.graphed_tree
    assert runner is not None and sorted(runner.draft_layers) == [1, 2, 3]
    # Built once per engine: the sampled step and the prompts' catch-up share them.
    assert eng.graphed_sampled is not None and eng.drafter is not None and eng.drafter.static_catch_up is not None
    assert runner.draft_layers is eng.graphed_sampled.draft_layers is eng.drafter.static_catch_up.draft_layers
    forwards: list[int] = []
    for draft in runner.draft_layers.values():
        forward = draft.forward
        draft.forward = lambda x, *a, f=forward: forwards.append(x.shape[0]) or f(x, *a)  # type: ignore[method-assign]
    outs = eng.generate(PROMPTS, GREEDY)
    want = layer_path.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base] == [w.token_ids for w in want]
    assert calls and len(forwards) >= len(calls) * 3
    for got, ref in zip(outs, want, strict=True):
        assert got.stats.accepted_per_position == ref.stats.accepted_per_position
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_adaptive_with_several_chain_arms_switches_among_them_exactly(tmp_path: Path, temperature: float) -> None:
    """``SpecConfig.chain_depths`` captures a chain arm of each depth beside the tree; stepping through every arm in turn, switches
    between the chains taking the batch over on the device, keeps the autoregressive tokens
    (sampled requests run their full length), feeds each chain the yield it would have had in
    the tree's steps (a sampled tree of 8 nodes drafts 5 deep: chain-6 learns nothing from it),
    and leaves nothing behind."""
    from engine.spec.adaptive import NO_SPEC
    from engine.spec.drafter import TreeBudget
    from tests.model_factory import build_checkpoint

    torch.manual_seed(0)
    folder = build_checkpoint(tmp_path / "m6", seed=4, vocab_size=6, num_nextn_predict_layers=6)
    spec = SpecConfig(method="adaptive", topk=2, depth=6, num_draft_tokens=8, chain_depths=(4, 6, 2))
    eng = LLMEngine.from_pretrained(folder, spec=spec, engine_config=STATIC)
    assert eng.adaptive is not None
    sampled = temperature > 0
    tree, *chains = eng.graphed_budgets(sampled=sampled)
    assert tree == eng.budget and [c.depth for c in chains] == [4, 6, 2]
    assert all(c.topk == 1 and c.num_draft_tokens == c.depth for c in chains)
    assert eng.adaptive.chains_for(sampled) == chains and eng.adaptive.chain == chains[0]
    order = [chains[0], chains[0], chains[1], chains[2], NO_SPEC, chains[1], tree, tree, chains[2], chains[0]]
    picks = iter(order * 100)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    used: set[TreeBudget] = set()
    for runner in eng._graphed_runners:
        run = runner.run
        runner.run = lambda seqs, *a, run=run, b=runner.budget: used.add(b) or run(seqs, *a)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=30, temperature=temperature, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    got = _serve(eng, requests)
    assert used == {tree, *chains}
    if not sampled:
        base = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="none"))
        assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in _serve(base, requests).items()}
    assert [len(o.token_ids) for o in got.values()] == [30] * len(PROMPTS)
    # The tree's steps told every chain no deeper than its drafts its yield on the same prompts.
    tree_depth = next(r.D for r in eng._graphed_runners if r.budget == tree and r.serves(params))
    for chain in [c for c in chains if c.depth <= tree_depth]:
        seen = eng.adaptive.arms._yield[(sampled, chain)][1]
        assert seen > eng.adaptive.arms._lifetime[(sampled, chain)][1], chain
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache[:, eng.static_scratch_blocks]) == 0


def test_chain_depths_are_checked() -> None:
    for bad in [(), (0,), (4, 4), (2.5,), (True,), [4]]:
        with pytest.raises(ValueError, match="chain_depths"):
            SpecConfig(method="adaptive", chain_depths=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chain_depths is for method 'adaptive'"):
        SpecConfig(method="tree", chain_depths=(4,))
    from engine.spec.adaptive import AdaptiveController
    from engine.spec.drafter import TreeBudget

    for chains in ({False: [], True: []}, {False: [TreeBudget(topk=1, depth=4, num_draft_tokens=4)], True: []}):
        with pytest.raises(ValueError, match="at least one chain arm"):
            AdaptiveController(None, TreeBudget(topk=2, depth=3, num_draft_tokens=4), chains)  # type: ignore[arg-type]
