"""A step that raises costs its batch a pause, not its answers; a request that always fails fails alone.

Failures are injected at three points of a step: before its decode (after its prefill, whose
first tokens are already appended), in the middle of its commits (some sequences have their
tokens, the others not), and right after a request ended in it (its output never returned).
Every speculation method runs, host-driven and through the static (CUDA-graph) code run
eagerly, steps launched ahead included. The failed step's requests are parked; resumed from what
their client received, every request must stream exactly the greedy tokens a fresh engine
produces; given up, they are gone and the others are untouched. Every freed KV block must be
zero, a session's given-up turn must be rolled back, and a request that fails every step it is
in must be the only one lost.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.sequence import SeqStatus
from engine.serving import EngineLoop, RequestFailed
from engine.serving.observer import NullObserver
from engine.step_failure import StepFailed

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
PROMPTS = {f"r{i}": [(3 * i + j) % 6 for j in range(5 + 2 * i)] for i in range(5)}
LATE = [5, 4, 3, 2, 1]
Reference = dict[tuple[int, ...], list[int]]


class Injected(RuntimeError):
    pass


def _engine(folder: Path, method: str, graphs: bool) -> LLMEngine:
    config = EngineConfig(cuda_graphs=graphs, overlap_steps=graphs, max_batch_size=2,
                          kv_memory_bytes=4 << 20, max_model_len=64)  # fmt: skip
    return LLMEngine.from_pretrained(folder, spec=SpecConfig(method=method), engine_config=config)  # type: ignore[arg-type]


def _inject(eng: LLMEngine, where: str, culprit: str | None = None) -> None:
    """Make the engine's next step raise at ``where`` (once); with ``culprit``, every step in
    which that request gets tokens raises."""
    if culprit is not None:
        real_append: Callable[..., None] = eng._append_tokens

        def always(seq: Any, *args: Any, **kwargs: Any) -> None:
            if seq.request_id == culprit:
                raise Injected(culprit)
            real_append(seq, *args, **kwargs)

        eng._append_tokens = always  # type: ignore[method-assign]
        return
    if where == "before_decode":  # asked by every decode step, launched ahead or not
        real_ask = eng._may_launch_ahead

        def ask(*args: Any, **kwargs: Any) -> Any:
            eng._may_launch_ahead = real_ask  # type: ignore[method-assign]
            raise Injected(where)

        eng._may_launch_ahead = ask  # type: ignore[method-assign]
        return
    real: Callable[..., None] = eng._append_tokens
    calls = [0]

    def append(seq: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if where == "mid_commit" and calls[0] == 2:
            eng._append_tokens = real  # type: ignore[method-assign]
            raise Injected(where)
        real(seq, *args, **kwargs)
        if where == "after_finish" and seq.status is not SeqStatus.RUNNING:
            eng._append_tokens = real  # type: ignore[method-assign]
            raise Injected(where)

    eng._append_tokens = append  # type: ignore[method-assign]


class Client:
    """Drives an engine as the serving loop does: streams each request's tokens, and after a
    failed step resumes each lost request from what it received (``resume``) or gives it up."""

    def __init__(self, eng: LLMEngine, resume: bool, reverse: bool = False) -> None:
        self.eng, self.resume, self.reverse = eng, resume, reverse
        self.received: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.lost: set[str] = set()
        self.failures = 0

    def step(self) -> None:
        try:
            outputs = self.eng.step()
        except StepFailed as exc:
            assert isinstance(exc.__cause__, Injected)
            self.failures += 1
            for rid in sorted(exc.request_ids, reverse=self.reverse):  # resumed last, run first
                if not (self.resume and self.eng.resume_request(rid, len(self.received.get(rid, [])))):
                    self.eng.abort_request(rid)
                    self.lost.add(rid)
            return
        for out in outputs:
            self.received.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert len(self.received[out.request_id]) == out.num_generated
            if out.finished:
                self.finished.add(out.request_id)

    def run(self) -> None:
        while self.eng.has_unfinished_requests():
            self.step()


@pytest.fixture(scope="module")
def alone(small_vocab_dir: Path) -> Reference:
    """Each prompt's greedy output, decoded alone by a fresh autoregressive engine (greedy
    speculation decodes the same tokens: the exactness tests check it)."""
    eng = _engine(small_vocab_dir, "none", False)
    return {tuple(p): eng.generate([p], GREEDY)[0].token_ids for p in [*PROMPTS.values(), LATE]}


def _assert_zeroed(eng: LLMEngine, idle_blocks: int) -> None:
    assert eng.kv_blocks_used == idle_blocks
    free = torch.tensor(sorted(set(range(eng.pool.num_blocks)) - set(eng.pool._owner)))
    assert not eng.pool.kv_cache[:, free].any()  # every freed block zeroed


@pytest.mark.parametrize("policy", ["resume", "give_up"])
@pytest.mark.parametrize("queue", ["waiting", "empty"])
@pytest.mark.parametrize("where", ["before_decode", "mid_commit", "after_finish"])
@pytest.mark.parametrize("method", ["none", "tree", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_failed_step_costs_its_batch_a_pause(
    small_vocab_dir: Path, alone: Reference, method: str, graphs: bool, where: str, queue: str, policy: str
) -> None:
    eng = _engine(small_vocab_dir, method, graphs)
    idle_blocks = eng.kv_blocks_used
    # Two run. The others wait for a batch slot through the failure, or arrive after it (with
    # nothing waiting, the static path launches each step ahead of its host work).
    early = PROMPTS if queue == "waiting" else {rid: PROMPTS[rid] for rid in ("r0", "r1")}
    for rid, prompt in early.items():
        eng.add_request(rid, prompt, GREEDY)
    client = Client(eng, resume=policy == "resume")
    for _ in range(2):
        client.step()
    assert {s.request_id for s in eng.scheduler.running} == {"r0", "r1"}
    _inject(eng, where)
    while not client.failures:
        assert eng.has_unfinished_requests()
        client.step()
    zeroed = {event.request_id for event in eng.drain_zero_events()}
    assert {"r0", "r1"} & zeroed  # the failed batch's blocks were zeroed at once
    for rid in PROMPTS.keys() - early.keys():
        eng.add_request(rid, PROMPTS[rid], GREEDY)
    client.run()
    eng.add_request("late", LATE, GREEDY)
    client.run()
    assert client.failures == 1
    if policy == "resume":
        assert not client.lost
    else:
        assert client.lost and client.lost <= {"r0", "r1"}
        assert all(eng.sequence(rid) is None for rid in client.lost)
    assert client.finished == {*PROMPTS, "late"} - client.lost
    for rid in client.finished:
        assert client.received[rid] == alone[tuple(PROMPTS.get(rid, LATE))], rid
    _assert_zeroed(eng, idle_blocks)


@pytest.mark.parametrize("first", ["r0", "r1"])
@pytest.mark.parametrize("method", ["none", "tree", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_request_that_always_fails_fails_alone(
    small_vocab_dir: Path, alone: Reference, method: str, graphs: bool, first: str
) -> None:
    """r1 makes every step it gets tokens in raise: the first failure parks r0 and r1, both are
    resumed, each runs alone until it has decoded a step (``first`` first; r1 first, r0 pauses
    while r1 fails alone), and only r1 is lost."""
    eng = _engine(small_vocab_dir, method, graphs)
    idle_blocks = eng.kv_blocks_used
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, GREEDY)
    _inject(eng, "", culprit="r1")
    client = Client(eng, resume=True, reverse=first == "r0")
    client.run()
    assert client.lost == {"r1"} and client.failures == 2
    assert client.finished == PROMPTS.keys() - {"r1"}
    for rid in client.finished:
        assert client.received[rid] == alone[tuple(PROMPTS[rid])], rid
    _assert_zeroed(eng, idle_blocks)


@pytest.mark.parametrize("method", ["none", "tree", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_request_failing_late_in_its_decoding_fails_alone(
    small_vocab_dir: Path, alone: Reference, method: str, graphs: bool
) -> None:
    """r1's steps fail from its second decode step on (counted from each start), so it passes
    the decode step it runs alone after the first failure and fails a batch again: resumed a second time, r0 and r1 each run
    alone until they end, and only r1 is lost (resumed once only, r0 had been lost with it)."""
    eng = _engine(small_vocab_dir, method, graphs)
    idle_blocks = eng.kv_blocks_used
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, GREEDY)
    real_append: Callable[..., None] = eng._append_tokens

    def append(seq: Any, *args: Any, **kwargs: Any) -> None:
        if seq.request_id == "r1" and seq.stats.num_steps >= 2:
            raise Injected("r1")
        real_append(seq, *args, **kwargs)

    eng._append_tokens = append  # type: ignore[method-assign]
    client = Client(eng, resume=True)
    running: list[set[str]] = []
    while eng.has_unfinished_requests():
        client.step()
        running.append({s.request_id for s in eng.scheduler.running})
    assert client.lost == {"r1"} and client.failures == 3
    assert client.finished == PROMPTS.keys() - {"r1"}
    for rid in client.finished:
        assert client.received[rid] == alone[tuple(PROMPTS[rid])], rid
    assert {"r0", "r2"} not in running[: running.index({"r2", "r3"})]  # r0 ended alone
    assert eng.scheduler.alone is None
    _assert_zeroed(eng, idle_blocks)


def test_a_session_turn_after_a_resumed_one_may_be_resumed(small_vocab_dir: Path, alone: Reference) -> None:
    """A failed step of an earlier turn counts against no later one: each turn's first failure
    is resumed."""
    eng = _engine(small_vocab_dir, "adaptive", True)
    eng.open_session("s")
    client = Client(eng, resume=True)
    for turn, prompt in enumerate(([1, 2, 3], [4, 0], [5, 5, 1])):
        eng.add_request(f"t{turn}", prompt, GREEDY, session_id="s")
        client.step()
        _inject(eng, "mid_commit")
        client.run()
        assert client.failures == turn + 1 and not client.lost
    eng.close_session("s")


@pytest.mark.parametrize("policy", ["resume", "give_up"])
@pytest.mark.parametrize("where", ["mid_commit", "after_finish"])
@pytest.mark.parametrize("method", ["none", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_failed_session_turn_is_resumed_or_rolled_back(
    small_vocab_dir: Path, method: str, graphs: bool, where: str, policy: str
) -> None:
    first, second, third = [1, 2, 3, 4], [5, 0, 1], [2, 2, 3, 5, 1]

    def turn(client: Client, rid: str, prompt: list[int]) -> list[int]:
        client.eng.add_request(rid, prompt, GREEDY, session_id="s")
        client.run()
        return client.received[rid]

    eng = _engine(small_vocab_dir, method, graphs)
    idle_blocks = eng.kv_blocks_used
    eng.open_session("s")
    client = Client(eng, resume=policy == "resume")
    out1 = turn(client, "t1", first)
    history = eng.session_num_tokens("s")
    assert eng.session_cached_tokens("s") == history - 1  # its last token runs with the next turn
    eng.add_request("t2", second, GREEDY, session_id="s")
    client.step()  # its prefill
    _inject(eng, where)
    client.run()
    assert client.failures == 1
    if policy == "resume":
        assert "t2" in client.finished and not client.lost
    else:
        assert client.lost == {"t2"}
        assert eng.session_num_tokens("s") == history  # the turn never happened
        assert eng.session_cached_tokens("s") == 0  # and its cache is recomputed
    out3 = turn(client, "t3", third)
    assert eng.close_session("s") > 0
    _assert_zeroed(eng, idle_blocks)

    fresh = Client(_engine(small_vocab_dir, method, graphs), resume=False)
    fresh.eng.open_session("s")
    assert turn(fresh, "t1", first) == out1
    if policy == "resume":
        assert turn(fresh, "t2", second) == client.received["t2"]
    assert turn(fresh, "t3", third) == out3


@pytest.mark.parametrize("culprit", [None, "r1"])
def test_the_serving_loop_resumes_the_batch_and_fails_only_the_culprit(
    small_vocab_dir: Path, alone: Reference, culprit: str | None
) -> None:
    """Through the serving loop: the first step fails mid-commit (once, or whenever r1 is in
    it); r0 and r1 resume from what their streams delivered; r2-r3 wait in the engine and r4
    in the loop's queue meanwhile. Every stream gets the exact greedy tokens, but r1's when it
    always fails: ``RequestFailed``."""
    eng = _engine(small_vocab_dir, "tree", True)
    idle_blocks = eng.kv_blocks_used
    failures: list[tuple[int, int]] = []  # (resumed, lost) per failed step

    class Observer(NullObserver):
        def on_step_failed(self, resumed: int, lost: int) -> None:
            failures.append((resumed, lost))

    loop = EngineLoop(lambda: eng, max_running=4, observer=Observer())

    async def serve() -> dict[str, list[int] | None]:
        loop.start()
        assert await asyncio.to_thread(loop.wait_ready, 30)
        await loop.call(lambda engine: _inject(engine, "mid_commit", culprit))
        streams = {rid: await loop.submit(rid, prompt, GREEDY) for rid, prompt in PROMPTS.items()}
        answers: dict[str, list[int] | None] = {}
        for rid, stream in streams.items():
            await stream.admitted
            tokens: list[int] = []
            try:
                while True:
                    out = await stream.get()
                    tokens += out.new_token_ids
                    if out.finished:
                        break
                answers[rid] = tokens
            except RequestFailed:
                answers[rid] = None
        return answers

    try:
        answers = asyncio.run(serve())
    finally:
        loop.stop()
    for rid, prompt in PROMPTS.items():
        assert answers[rid] == (None if rid == culprit else alone[tuple(prompt)]), rid
    assert failures == ([(2, 0)] if culprit is None else [(2, 0), (0, 1)])
    assert loop.num_active == 0
    _assert_zeroed(eng, idle_blocks)


@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_seeded_sampled_request_is_resumed_exactly(small_vocab_dir: Path, graphs: bool) -> None:
    """Its draws are keyed by seed and position (``engine.keyed_noise``), so after a resume it
    continues its seed's tokens: it ends with the tokens a run without the failure gives, and
    the greedy and the unseeded sampled requests of the batch are resumed too."""
    seeded = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3)
    unseeded = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0)
    eng = _engine(small_vocab_dir, "tree", graphs)
    eng.scheduler.max_batch_size = 3
    eng.add_request("greedy", PROMPTS["r0"], GREEDY)
    eng.add_request("seeded", PROMPTS["r1"], seeded)
    eng.add_request("sampled", PROMPTS["r2"], unseeded)
    client = Client(eng, resume=True)
    client.step()
    _inject(eng, "mid_commit")
    client.run()
    assert client.failures == 1 and not client.lost
    assert client.finished == {"greedy", "seeded", "sampled"}
    assert len(client.received["sampled"]) == 10
    fresh = _engine(small_vocab_dir, "tree", graphs).generate([PROMPTS["r1"]], seeded)[0].token_ids
    assert client.received["seeded"] == fresh
    assert fresh == _engine(small_vocab_dir, "none", graphs).generate([PROMPTS["r1"]], seeded)[0].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["tree", "adaptive"])
def test_failed_steps_are_resumed_exactly_with_cuda_graphs_on_gpu(small_vocab_dir: Path, method: str) -> None:
    """The same on a GPU in float32: captured CUDA graphs, Triton kernels and steps launched
    ahead (the defaults there), every injection point, then a request that always fails."""

    def engine(m: str) -> LLMEngine:
        config = EngineConfig(max_batch_size=2, kv_memory_bytes=4 << 20, max_model_len=64)
        return LLMEngine.from_pretrained(small_vocab_dir, device="cuda", dtype="float32",
                                         spec=SpecConfig(method=m), engine_config=config)  # type: ignore[arg-type]  # fmt: skip

    reference = engine("none")
    expected = {rid: reference.generate([p], GREEDY)[0].token_ids for rid, p in PROMPTS.items()}
    for where in ("before_decode", "mid_commit", "after_finish"):
        eng = engine(method)
        idle_blocks = eng.kv_blocks_used
        for rid in ("r0", "r1"):  # nothing waits: steps are launched ahead
            eng.add_request(rid, PROMPTS[rid], GREEDY)
        client = Client(eng, resume=True)
        for _ in range(2):
            client.step()
        _inject(eng, where)
        while not client.failures:
            assert eng.has_unfinished_requests(), where
            client.step()
        for rid in ("r2", "r3", "r4"):
            eng.add_request(rid, PROMPTS[rid], GREEDY)
        client.run()
        assert not client.lost and client.finished == set(PROMPTS), where
        assert {rid: client.received[rid] for rid in PROMPTS} == expected, where
        _assert_zeroed(eng, idle_blocks)
    eng = engine(method)
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, GREEDY)
    _inject(eng, "", culprit="r1")
    client = Client(eng, resume=True)
    client.run()
    assert client.lost == {"r1"}
    assert {rid: client.received[rid] for rid in client.finished} == {r: expected[r] for r in client.finished}


@pytest.mark.parametrize("seed", range(8))
def test_random_failures_among_arrivals_sessions_and_resumes(small_vocab_dir: Path, seed: int) -> None:
    """A random engine (method, static path, steps launched ahead, batch limit) serves random
    arrivals, some in sessions, while random steps fail (before or after a request's commit, or
    whenever one culprit is in them) and each lost request is resumed or given up at random.
    Every request ends finished or lost, every finished one outside a session streams exactly
    the greedy tokens a fresh engine produces, and every block comes back zeroed."""
    rng = random.Random(seed)
    method, graphs = rng.choice(["none", "chain", "tree", "adaptive"]), rng.random() < 0.5
    config = EngineConfig(cuda_graphs=graphs, overlap_steps=graphs and rng.random() < 0.7,
                          max_batch_size=rng.choice([1, 2, 3]), kv_memory_bytes=4 << 20, max_model_len=64)  # fmt: skip
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method), engine_config=config)  # type: ignore[arg-type]
    reference = _engine(small_vocab_dir, "none", False)
    idle_blocks = eng.kv_blocks_used
    p_fail = rng.choice([0.05, 0.15])
    culprit = f"q{rng.randrange(8)}" if rng.random() < 0.4 else None
    real_append: Callable[..., None] = eng._append_tokens

    def append(seq: Any, *args: Any, **kwargs: Any) -> None:
        if seq.request_id == culprit or rng.random() < p_fail:
            raise Injected("before")
        real_append(seq, *args, **kwargs)
        if rng.random() < p_fail / 2:
            raise Injected("after")

    eng._append_tokens = append  # type: ignore[method-assign]
    client = Client(eng, resume=True)
    client.resume = False
    prompts: dict[str, list[int]] = {}
    sessions: list[str] = []
    in_session: set[str] = set()
    for _ in range(300):
        if len(prompts) < 8 and rng.random() < 0.3:
            rid, prompt = f"q{len(prompts)}", [rng.randrange(6) for _ in range(rng.randint(1, 10))]
            session = None
            if rng.random() < 0.25:
                session = f"s{len(sessions)}"
                eng.open_session(session)
                sessions.append(session)
                in_session.add(rid)
            prompts[rid] = prompt
            eng.add_request(rid, prompt, GREEDY, session_id=session)
        if eng.has_unfinished_requests():
            client.resume = rng.random() < 0.8
            client.step()
    eng._append_tokens = real_append  # type: ignore[method-assign]
    client.run()
    assert client.failures and client.finished | client.lost == set(prompts)
    for rid in client.finished - in_session:
        assert client.received[rid] == reference.generate([prompts[rid]], GREEDY)[0].token_ids, rid
    for session in sessions:
        eng.close_session(session)
    assert eng.scheduler.alone is None
    _assert_zeroed(eng, idle_blocks)
