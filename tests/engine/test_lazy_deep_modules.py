"""Graphed steps that run only the MTP modules they draft with (``SpecConfig.lazy_deep_modules``).

A chain 4 deep on a six-module model runs modules 1-4; module 5's inputs (module 4's outputs
over each step's committed rows) are logged (``engine.spec.deep_row_log``) and modules 5-6
catch up when an arm drafting with them runs next. Checked on the static (CUDA-graph) path run
eagerly: every switch among the arms, autoregressive steps and sessions keeps the
autoregressive tokens; the tree drafts what it drafts when every step runs every module (the
MTP state it reads is the same); the chain's steps run modules 1-4 only; a failed step's batch
is resumed exactly; nothing is left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.sequence import SeqStatus, Sequence
from engine.spec.adaptive import NO_SPEC
from engine.spec.deep_row_log import DeepRowLog
from engine.spec.drafter import TreeBudget
from engine.step_failure import StepFailed

PROMPTS = [[1, 2, 3, 4, 5, 0, 1], [2, 3, 1, 4, 0], [4] * 20, [5, 1, 2, 2, 3, 1]]
STATIC = EngineConfig(cuda_graphs=True, overlap_steps=True)  # the CUDA-graph code path, eager on CPU
TREE = {"topk": 2, "depth": 6, "num_draft_tokens": 8}  # as deep as the modules: runs them all


def _engine(folder: Path, lazy: bool, chains: tuple[int, ...] = (4, 2)) -> LLMEngine:
    spec = SpecConfig(method="adaptive", chain_depths=chains, lazy_deep_modules=lazy, **TREE)  # type: ignore[arg-type]
    return LLMEngine.from_pretrained(folder, spec=spec, engine_config=STATIC)


def _force(eng: LLMEngine, order: list[TreeBudget]) -> None:
    picks = iter(order * 100)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[union-attr, method-assign]


def _order(eng: LLMEngine, sampled: bool) -> list[TreeBudget]:
    tree, chain4, chain2 = eng.graphed_budgets(sampled=sampled)
    return [chain4, chain4, chain4, tree, chain4, NO_SPEC, chain4, chain2, chain2, tree, NO_SPEC, NO_SPEC,
            chain2, chain4, tree, tree]  # fmt: skip


def _serve(eng: LLMEngine, params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_the_chain_runs_the_modules_it_drafts_with_and_the_tree_all(six_module_dir: Path) -> None:
    eng = _engine(six_module_dir, lazy=True)
    runners = {(r.budget.depth, r.budget.topk, type(r).__name__): r for r in eng._graphed_runners}
    assert {key: r.k for key, r in runners.items()} == {
        (6, 2, "GraphedGreedyTree"): 6, (4, 1, "GraphedGreedyTree"): 4, (2, 1, "GraphedGreedyTree"): 2,
        (6, 2, "GraphedSampledTree"): 5, (4, 1, "GraphedSampledTree"): 4, (2, 1, "GraphedSampledTree"): 2,
    }  # fmt: skip  (a sampled tree of 8 nodes drafts 5 deep)
    assert all(r.skips == (r.k < 6) for r in runners.values())
    modules: list[int] = []
    import engine.spec.graphed_tree as graphed_tree

    real = graphed_tree.forward_mtp_fused

    def traced(model: Any, drafts: Any, module: int, *args: Any) -> Any:
        modules.append(module)
        return real(model, drafts, module, *args)

    graphed_tree.forward_mtp_fused = traced  # type: ignore[assignment]
    try:
        chain4 = eng.graphed_budgets(sampled=False)[1]
        _force(eng, [chain4])
        eng.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    finally:
        graphed_tree.forward_mtp_fused = real  # type: ignore[assignment]
    assert modules and set(modules) == {1, 2, 3, 4}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_switching_among_lazy_chains_the_tree_and_autoregressive_steps_is_exact(
    six_module_dir: Path, temperature: float
) -> None:
    torch.manual_seed(0)
    eng = _engine(six_module_dir, lazy=True)
    sampled = temperature > 0
    _force(eng, _order(eng, sampled))
    logged: list[int] = []
    append = eng._deep_log.append
    eng._deep_log.append = lambda *a, **k: logged.append(a[0]) or append(*a, **k)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=40, temperature=temperature, ignore_eos=True)
    got = _serve(eng, params)
    assert set(logged) == ({4, 2} if not sampled else {5, 4, 2})  # every lazy arm ran and logged
    if not sampled:
        base = LLMEngine.from_pretrained(six_module_dir, spec=SpecConfig(method="none"))
        assert got == _serve(base, params)
    assert sorted(len(t) for t in got.values()) == [40] * len(PROMPTS)
    assert len(eng._deep_log) == 0  # idle: cleared
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache[:, eng.static_scratch_blocks]) == 0


def test_the_tree_after_lazy_chains_drafts_what_it_drafts_when_every_step_runs_every_module(
    six_module_dir: Path,
) -> None:
    """The same forced arms, lazy and not: the deeper modules caught up late hold what steps
    running every module would have left (float32, the same rows through other shapes), so
    every step accepts the same drafts."""
    accepted = []
    for lazy in (False, True):
        eng = _engine(six_module_dir, lazy=lazy)
        _force(eng, _order(eng, sampled=False))
        per_step: list[tuple[str, int]] = []
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            per_step += [(o.request_id, o.step_accepted) for o in eng.step() if o.step_drafted]
        accepted.append(per_step)
    assert accepted[0] == accepted[1] and sum(a for _, a in accepted[0]) > 20


def test_a_session_continues_after_lazy_chain_steps(six_module_dir: Path) -> None:
    """A session's turn decoded on the lazy chain leaves its deeper modules' rows logged; the
    next turn's prefill hands them out and its tree steps draft from caught-up modules."""
    eng = _engine(six_module_dir, lazy=True)
    tree, chain4, _ = eng.graphed_budgets(sampled=False)
    ref = LLMEngine.from_pretrained(six_module_dir, spec=SpecConfig(method="none"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    turns = [[1, 2, 3, 4, 5], [0, 1], [3, 3, 2]]
    for e in (eng, ref):
        e.open_session("s")
    outs: dict[LLMEngine, list[list[int]]] = {eng: [], ref: []}
    for t, prompt in enumerate(turns):
        _force(eng, [chain4] if t % 2 == 0 else [tree])
        for e in (eng, ref):
            e.add_request(f"t{t}", prompt, params, session_id="s")
            tokens: list[int] = []
            while e.has_unfinished_requests():
                for o in e.step():
                    tokens += o.new_token_ids
            outs[e].append(tokens)
        if t == 0:
            session = eng._sessions["s"]
            assert eng._deep_log.holds(session)  # its deeper modules' inputs wait in the log
    assert outs[eng] == outs[ref]
    for e in (eng, ref):
        e.close_session("s")
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)


def test_a_failed_step_on_the_lazy_chain_resumes_exactly(six_module_dir: Path) -> None:
    eng = _engine(six_module_dir, lazy=True)
    tree, chain4, _ = eng.graphed_budgets(sampled=False)
    _force(eng, [chain4, chain4, tree])
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, params)
    received: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    real = eng._append_tokens
    calls = [0]

    def failing(seq: Sequence, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 40:
            raise RuntimeError("injected")
        real(seq, *args, **kwargs)

    eng._append_tokens = failing  # type: ignore[method-assign]
    failures = 0
    while eng.has_unfinished_requests():
        try:
            outs = eng.step()
        except StepFailed as exc:
            failures += 1
            for rid in exc.request_ids:
                assert eng.resume_request(rid, len(received[rid]))
            continue
        for o in outs:
            received[o.request_id] += o.new_token_ids
    assert failures == 1
    base = LLMEngine.from_pretrained(six_module_dir, spec=SpecConfig(method="none"))
    assert received == _serve(base, params)
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    free = torch.tensor(sorted(set(range(eng.pool.num_blocks)) - set(eng.pool._owner)))
    assert not eng.pool.kv_cache[:, free].any()


def test_lazy_deep_modules_is_off_by_default(six_module_dir: Path) -> None:
    eng = LLMEngine.from_pretrained(six_module_dir, spec=SpecConfig(method="adaptive"), engine_config=STATIC)
    assert not any(r.skips for r in eng._graphed_runners)


# ---- the log itself ----
def _seq(n_modules: int = 3) -> Sequence:
    seq = Sequence("r", [0] * 30, SamplingParams(), torch.Generator(), num_mtp_modules=n_modules)
    seq.status = SeqStatus.RUNNING
    return seq


def test_the_log_hands_each_sequence_its_rows_in_order_in_one_push() -> None:
    a, b, done = _seq(), _seq(), _seq()
    log = DeepRowLog()
    steps = [torch.randn(3, 4, 2) for _ in range(3)]
    counts = [[2, 1, 4], [3, 2, 1], [1, 4, 2]]
    starts = [[5, 0, 9], [7, 1, 13], [10, 3, 14]]
    for rows, c, s in zip(steps, counts, starts, strict=True):
        log.append(2, [a, b, done], rows, c, s)
    assert len(log) == 3 and log.holds(a) and log.holds(done)
    pushed: list[tuple[Sequence, int, int, torch.Tensor]] = []
    for seq in (a, b, done):
        seq.push_hidden = lambda d, st, r, seq=seq: pushed.append((seq, d, st, r))  # type: ignore[method-assign]
    done.status = SeqStatus.FINISHED
    log.flush()
    assert len(log) == 0 and not log.holds(a)
    want_a = torch.cat([steps[0][0, :2], steps[1][0, :3], steps[2][0, :1]])
    want_b = torch.cat([steps[0][1, :1], steps[1][1, :2], steps[2][1, :4]])
    assert [(s, d, st) for s, d, st, _ in pushed] == [(a, 2, 5), (b, 2, 0)]
    assert torch.equal(pushed[0][3], want_a) and torch.equal(pushed[1][3], want_b)


def test_rows_out_of_order_are_an_error_and_a_new_batch_starts_a_new_run() -> None:
    a, b = _seq(), _seq()
    log = DeepRowLog()
    log.append(1, [a], torch.zeros(1, 3, 2), [2], [4])
    log.append(1, [a, b], torch.zeros(2, 3, 2), [1, 1], [6, 0])  # another batch: its own run
    assert len(log._runs) == 2
    log.flush()
    assert a.hidden_rows(1) is not None and a.hidden_rows(1).shape[0] == 3  # type: ignore[union-attr]
    log.append(1, [b], torch.zeros(1, 3, 2), [2], [1])
    log.append(1, [b], torch.zeros(1, 3, 2), [2], [4])  # 1 + 2 = 3 expected
    with pytest.raises(AssertionError, match="out of order"):
        log.flush()


def test_the_log_flushes_itself_when_full() -> None:
    a = _seq()
    log = DeepRowLog(max_steps=2)
    log.append(1, [a], torch.zeros(1, 2, 2), [1], [0])
    log.append(1, [a], torch.zeros(1, 2, 2), [2], [1])
    assert len(log) == 0 and a.hidden_rows(1).shape[0] == 3  # type: ignore[union-attr]


def _deep_entries(eng: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Each running sequence's committed cache entries of modules 5 and 6 (module d's entry for
    hidden index t sits at the sequence's slot t)."""
    bs, out = eng.pool.block_size, {}
    cache = eng.pool.kv_cache.flatten(1, 2)  # [layers, slots, latent]
    for seq in eng.scheduler.running:
        entries = []
        for d in (5, 6):
            pos = torch.arange(seq.mtp_committed[d - 1])
            slots = torch.tensor(seq.block_ids)[pos // bs] * bs + pos % bs
            entries.append(cache[eng.model.mtp_cache_layer(d), slots])
        out[seq.request_id] = entries
    return out


def test_after_each_tree_step_the_deeper_modules_hold_what_every_step_running_them_leaves(
    six_module_dir: Path,
) -> None:
    """The same forced arms, lazy and not: after every tree step (which reads modules 5 and 6)
    their cache entries match, the lazy engine's caught up late from the logged rows."""
    snapshots: list[list[dict[str, list[torch.Tensor]]]] = []
    for lazy in (False, True):
        eng = _engine(six_module_dir, lazy=lazy)
        tree = eng.graphed_budgets(sampled=False)[0]
        _force(eng, _order(eng, sampled=False))
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        snaps = []
        while eng.has_unfinished_requests():
            eng.step()
            if eng.last_decode_budget == "tree-2x6-8":
                snaps.append(_deep_entries(eng))
        snapshots.append(snaps)
        del tree
    full, lazy_snaps = snapshots
    assert len(full) == len(lazy_snaps) >= 3
    for a, b in zip(full, lazy_snaps, strict=True):
        assert a.keys() == b.keys()
        for rid in a:
            for full_entries, lazy_entries in zip(a[rid], b[rid], strict=True):
                assert full_entries.shape == lazy_entries.shape and full_entries.abs().sum() > 0
                torch.testing.assert_close(lazy_entries, full_entries, rtol=1e-4, atol=1e-5)
