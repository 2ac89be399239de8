"""Decode steps launched ahead of their turn (``EngineConfig.overlap_steps``, engine/launch_ahead.py),
on the CPU, where they change nothing but the order of the work: every output must be the one
the engine gives without them, whatever stops, arrives or is aborted while a step is in flight,
and every block released must be zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.outputs import RequestOutput

PROMPTS = [[1, 2, 3, 4, 5, 0, 1], [2, 3, 1, 4, 0], [4] * 20, [5, 1, 2, 2, 3, 1], [3, 3, 2]]
MAX_TOKENS = [17, 9, 30, 4, 23]  # requests stop at different steps: launched steps carry them
SPECS = [
    SpecConfig(method="none"),
    SpecConfig(method="chain", num_draft_tokens=4),
    SpecConfig(method="tree", topk=3, depth=4, num_draft_tokens=9),
    SpecConfig(method="adaptive"),  # reads a launched step only while it would choose its budget again
]


def _engine(folder: Path, spec: SpecConfig, overlap: bool) -> tuple[LLMEngine, list[int]]:
    """An engine on the CUDA-graph code path (eager on the CPU); the list counts the steps read
    after being launched ahead."""
    eng = LLMEngine.from_pretrained(folder, spec=spec, engine_config=EngineConfig(cuda_graphs=True, overlap_steps=overlap))
    read: list[int] = []
    read_ahead = eng._read_ahead
    eng._read_ahead = lambda launched: read.append(1) or read_ahead(launched)  # type: ignore[method-assign]
    return eng, read


def _serve(eng: LLMEngine, params: list[SamplingParams], late: int | None = None,
           abort_after: int | None = None) -> dict[str, RequestOutput]:  # fmt: skip
    """Requests 0..n-1 (request ``late`` added only after 3 steps); request 0 aborted after
    ``abort_after`` steps. Final outputs by id."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        if i != late:
            eng.add_request(str(i), prompt, p)
    final: dict[str, RequestOutput] = {}
    steps = 0
    while eng.has_unfinished_requests() or (late is not None and str(late) not in final):
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        steps += 1
        if steps == 3 and late is not None:
            eng.add_request(str(late), PROMPTS[late], params[late])
        if steps == abort_after:
            eng.abort_request("0")
    return final


def _free_blocks_are_zero(eng: LLMEngine) -> bool:
    free = [b for b in range(eng.pool.num_blocks) if eng.pool.owner_of(b) is None]
    return bool((eng.pool.kv_cache[:, free] == 0).all())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_steps_launched_ahead_give_the_same_greedy_tokens(small_vocab_dir: Path, spec: SpecConfig) -> None:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    base, not_read = _engine(small_vocab_dir, spec, overlap=False)
    expected = _serve(base, params)
    eng, read = _engine(small_vocab_dir, spec, overlap=True)
    got = _serve(eng, params)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in expected.items()}
    assert [len(got[str(i)].token_ids) for i in range(len(PROMPTS))] == MAX_TOKENS
    assert not not_read and len(read) >= 5  # the overlapped engine read steps launched ahead
    assert _free_blocks_are_zero(eng)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_an_arrival_and_an_abort_while_a_step_is_in_flight(small_vocab_dir: Path, spec: SpecConfig) -> None:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    expected = _serve(_engine(small_vocab_dir, spec, overlap=False)[0], params, late=4, abort_after=5)
    eng, read = _engine(small_vocab_dir, spec, overlap=True)
    got = _serve(eng, params, late=4, abort_after=5)
    assert "0" not in got and "0" not in expected  # aborted, never finished
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in expected.items()}
    assert read
    assert eng.pool.num_free == base_free(eng) and _free_blocks_are_zero(eng)


def base_free(eng: LLMEngine) -> int:
    """Blocks free when no request holds any (the graphed steps' scratch stays allocated)."""
    return eng.pool.num_blocks - sum(1 for b in range(eng.pool.num_blocks) if eng.pool.owner_of(b) is not None)


@pytest.mark.parametrize("mixed", [False, True], ids=["sampled", "mixed-with-greedy"])
def test_seeded_sampling_is_reproduced_with_steps_launched_ahead(small_vocab_dir: Path, mixed: bool) -> None:
    """Each seeded request draws with the noise keyed by its seed and the position of the
    token (a step launched ahead draws one position further on); greedy rows in the same batch
    take the argmax."""
    params = [SamplingParams(max_tokens=m, temperature=0.0 if mixed and i % 2 else 0.9, seed=100 + i,
                             ignore_eos=True) for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    spec = SpecConfig(method="none")
    expected = _serve(_engine(small_vocab_dir, spec, overlap=False)[0], params)
    eng, read = _engine(small_vocab_dir, spec, overlap=True)
    got = _serve(eng, params)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in expected.items()}
    assert read


def test_a_session_batch_is_not_launched_ahead(small_vocab_dir: Path) -> None:
    """A session keeps its blocks after a turn: a step launched past its stop would leave KV
    behind in them, so its steps are not launched ahead, and nothing past its tokens is kept."""
    eng, read = _engine(small_vocab_dir, SpecConfig(method="chain", num_draft_tokens=4), overlap=True)
    eng.open_session("s")
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    session_id="s")  # fmt: skip
    while eng.has_unfinished_requests():
        eng.step()
    assert not read
    assert eng.session_num_tokens("s") == len(PROMPTS[0]) + 12


def test_sampled_graphed_steps_launched_ahead_finish_every_request(small_vocab_dir: Path) -> None:
    """Unseeded sampled requests take the graphed sampled step: launched ahead, read over the
    requests still decoding as others stop, every request ends at its max_tokens."""
    params = [SamplingParams(max_tokens=m, temperature=0.8, ignore_eos=True) for m in MAX_TOKENS]
    eng, read = _engine(small_vocab_dir, SpecConfig(method="chain", num_draft_tokens=4), overlap=True)
    assert eng.graphed_sampled is not None
    got = _serve(eng, params)
    assert [len(got[str(i)].token_ids) for i in range(len(PROMPTS))] == MAX_TOKENS
    assert len(read) >= 3 and _free_blocks_are_zero(eng)


@pytest.mark.parametrize("forced", ["none", "chain"])
def test_a_step_launched_ahead_costs_its_whole_turn(small_vocab_dir: Path, forced: str) -> None:
    """What adaptive speculation learns a step launched ahead costs is its turn: from its launch
    to its successor's, the host work done meanwhile included (here a caller that spends 30 ms
    on each step's outputs, as the device would compute the launched step meanwhile). Timed
    from its read alone it cost ~nothing, and the controller took it for free. A lower bound:
    a busy machine only lengthens the turns."""
    import time  # noqa: PLC0415

    from engine.spec.adaptive import NO_SPEC  # noqa: PLC0415

    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"),
                                    engine_config=EngineConfig(cuda_graphs=True, overlap_steps=True))  # fmt: skip
    adaptive = eng.adaptive
    assert adaptive is not None
    arm = NO_SPEC if forced == "none" else adaptive.chain
    adaptive.forced = arm
    observed: list[tuple[bool, float]] = []  # (read ahead, seconds) of each step observed
    reading = [False]
    read_ahead, observe = eng._read_ahead, adaptive.observe

    def read_ahead_spy(launched):  # type: ignore[no-untyped-def]
        reading[0] = True
        try:
            return read_ahead(launched)
        finally:
            reading[0] = False

    def observe_spy(batch_size, budget, seconds, tokens, sampled=False):  # type: ignore[no-untyped-def]
        observed.append((reading[0], seconds))
        observe(batch_size, budget, seconds, tokens, sampled)

    eng._read_ahead = read_ahead_spy  # type: ignore[method-assign]
    adaptive.observe = observe_spy  # type: ignore[method-assign]
    eng.add_request("a", PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        time.sleep(0.03)
    ahead = [seconds for was_read_ahead, seconds in observed if was_read_ahead]
    assert len(ahead) >= 5 and min(ahead) >= 0.03


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_a_random_stream_of_arrivals_aborts_and_stops_gives_the_same_greedy_outputs(
    small_vocab_dir: Path, spec: SpecConfig
) -> None:
    """Requests arrive between steps, some with stop ids or EOS, some aborted mid-flight, one in
    a session; sampled requests share the batch (their tokens are not compared). The greedy
    outputs of the overlapped engine are the plain engine's, and every free block is zero."""
    import random

    def play(eng: LLMEngine) -> dict[str, list[int]]:
        rnd = random.Random(7)
        eng.open_session("s")
        final: dict[str, list[int]] = {}
        pending = list(range(14))
        step = 0
        while pending or eng.has_unfinished_requests():
            if pending and rnd.random() < 0.5:
                i = pending.pop(0)
                prompt = [rnd.randrange(1, 6) for _ in range(rnd.randrange(3, 12))]
                sampled = i % 4 == 3
                params = SamplingParams(max_tokens=rnd.randrange(3, 25), temperature=0.8 if sampled else 0.0,
                                        stop_token_ids=[5] if i % 5 == 0 else [], ignore_eos=i % 3 != 0)  # fmt: skip
                eng.add_request(f"r{i}", prompt, params, session_id="s" if i == 6 else None)
            for o in eng.step():
                if o.finished and int(o.request_id[1:]) % 4 != 3:  # greedy ones
                    final[o.request_id] = o.token_ids
            step += 1
            if step in (9, 17):
                for rid in ("r1", "r8"):
                    if eng.sequence(rid) is not None:
                        eng.abort_request(rid)
        return final

    expected = play(_engine(small_vocab_dir, spec, overlap=False)[0])
    eng, read = _engine(small_vocab_dir, spec, overlap=True)
    assert play(eng) == expected
    assert read
    assert _free_blocks_are_zero(eng)


def _serve_one_by_one(eng: LLMEngine, params: SamplingParams) -> tuple[list[list[int]], list[str]]:
    """Requests served one after another, each a batch of its own; their tokens, and what the
    step after each prefill step read as launched ahead (the kind of step)."""
    outputs, first_reads = [], []
    step_no = [0]
    read_ahead = eng._read_ahead

    def spy(launched):  # type: ignore[no-untyped-def]
        if step_no[0] == 1:
            first_reads.append(type(launched).__name__)
        return read_ahead(launched)

    eng._read_ahead = spy  # type: ignore[method-assign]
    for i, prompt in enumerate(PROMPTS[:3]):
        eng.add_request(str(i), prompt, params)
        step_no[0] = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outputs.append(o.token_ids)
            step_no[0] += 1
    return outputs, first_reads


@pytest.mark.parametrize(("spec", "temperature", "seed"), [
    (SPECS[0], 0.0, None), (SPECS[1], 0.0, None), (SPECS[2], 0.0, None), (SPECS[3], 0.0, None),
    (SPECS[0], 0.9, 5), (SPECS[1], 0.9, None),
], ids=["none", "chain", "tree", "adaptive", "none-seeded-sampled", "chain-sampled"])  # fmt: skip
def test_a_prefill_launches_its_batchs_first_decode_step(
    small_vocab_dir: Path, spec: SpecConfig, temperature: float, seed: int | None
) -> None:
    """A request arriving alone: its prefill step also launches its first decode step (the
    graphed step the prefill caught the MTP modules up for, or an autoregressive one), which the
    next step reads as a step launched ahead; the outputs are an engine's that does not
    (greedy tokens, seeded draws; unseeded sampled requests run their full length)."""
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True)
    runs = {}
    for launch in (False, True):
        cfg = EngineConfig(cuda_graphs=True, overlap_steps=True, launch_after_prefill=launch)
        eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=cfg)
        runs[launch] = _serve_one_by_one(eng, params)
        assert _free_blocks_are_zero(eng)
    (before, not_read), (after, read) = runs[False], runs[True]
    if temperature == 0.0 or seed is not None:
        assert after == before
    assert [len(t) for t in after] == [12] * 3
    assert not not_read
    want = "ARLaunch" if spec.method in ("none", "adaptive") else "Graphed"
    assert len(read) == 3 and all(r.startswith(want) for r in read), read


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_switch_of_drafting_arm_is_launched_ahead(small_vocab_dir: Path, temperature: float) -> None:
    """Adaptive speculation switching the batch between the tree and the chain launches the new
    arm's first step as soon as the last one is read (``LLMEngine._launch_switched``), its runner
    taking the batch over on the device: the step after a switch is read as launched ahead, and
    greedy tokens stay the autoregressive ones (sampled requests run their full length)."""
    torch.manual_seed(0)  # unseeded sampled requests draw from the global generator
    params = [SamplingParams(max_tokens=m, temperature=temperature, ignore_eos=True) for m in MAX_TOKENS]
    eng, _ = _engine(small_vocab_dir, SpecConfig(method="adaptive"), overlap=True)
    assert eng.adaptive is not None
    tree, chain = eng.graphed_budgets(sampled=temperature > 0)
    picks = iter(([tree] * 3 + [chain] * 3) * 100)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    switching = [False]
    launched: list[object] = []  # the budget of each step launched at a switch
    for runner in eng._graphed_runners:
        launch = runner.launch

        def launch_traced(seqs, r=runner, launch=launch):  # type: ignore[no-untyped-def]
            if switching[0]:
                launched.append(r.budget)
            return launch(seqs)

        runner.launch = launch_traced  # type: ignore[method-assign]
    switched = eng._launch_switched

    def switched_traced(*args):  # type: ignore[no-untyped-def]
        switching[0] = True
        try:
            return switched(*args)
        finally:
            switching[0] = False

    eng._launch_switched = switched_traced  # type: ignore[method-assign]
    got = _serve(eng, params)
    if temperature == 0.0:
        base = _serve(_engine(small_vocab_dir, SpecConfig(method="none"), overlap=False)[0], params)
        assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in base.items()}
    assert [len(got[str(i)].token_ids) for i in range(len(PROMPTS))] == MAX_TOKENS
    # Switches between steps launched ahead launch the new arm's step (both ways).
    assert {tree, chain} <= set(launched), launched
    assert _free_blocks_are_zero(eng)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_a_request_aborted_after_its_prefill_launched_a_step_leaves_nothing(
    small_vocab_dir: Path, spec: SpecConfig
) -> None:
    """The first decode step a prefill launched writes into the request's blocks; aborted before
    that step is read, the request releases them zeroed after it, and the engine serves the
    next request as if nothing had happened."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng, _ = _engine(small_vocab_dir, spec, overlap=True)
    free = eng.pool.num_free
    eng.add_request("a", PROMPTS[0], params)
    eng.step()  # the prefill, which launches the first decode step
    assert eng._ahead is not None
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    eng.wait_for_device()
    assert eng.pool.num_free == free and _free_blocks_are_zero(eng)
    expected = _engine(small_vocab_dir, spec, overlap=False)[0].generate([PROMPTS[1]], params)
    assert [o.token_ids for o in eng.generate([PROMPTS[1]], params)] == [o.token_ids for o in expected]
