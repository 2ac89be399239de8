"""A step that raises loses its own batch only, and leaves the engine as if the batch had never run.

Failures are injected at three points of a step: before its decode (after its prefill, whose
first tokens are already appended), in the middle of its commits (some sequences have their
tokens, the others not), and right after a request ended in it (its output never returned).
Every speculation method runs, host-driven and through the static (CUDA-graph) code run
eagerly, steps launched ahead included. After the failure the requests that waited for a batch
slot, and later ones, must produce exactly what a fresh engine produces; every KV block must
come back zeroed; a session's failed turn must be rolled back, its next turn answered as if the
failed one never happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.sequence import SeqStatus
from engine.serving import EngineLoop, RequestFailed
from engine.step_failure import StepFailed

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
PROMPTS = {f"r{i}": [(3 * i + j) % 6 for j in range(5 + 2 * i)] for i in range(5)}
LATE = [5, 4, 3, 2, 1]


class Injected(RuntimeError):
    pass


def _engine(folder: Path, method: str, graphs: bool) -> LLMEngine:
    config = EngineConfig(cuda_graphs=graphs, overlap_steps=graphs, max_batch_size=2,
                          kv_memory_bytes=4 << 20, max_model_len=64)  # fmt: skip
    return LLMEngine.from_pretrained(folder, spec=SpecConfig(method=method), engine_config=config)  # type: ignore[arg-type]


def _inject(eng: LLMEngine, where: str) -> None:
    """Make the engine's next step raise at ``where`` (once)."""
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


def _run(eng: LLMEngine, finished: dict[str, list[int]]) -> set[str]:
    """Step until nothing is left; returns the requests lost to a failed step."""
    lost: set[str] = set()
    while eng.has_unfinished_requests():
        try:
            outputs = eng.step()
        except StepFailed as exc:
            assert isinstance(exc.__cause__, Injected)
            lost |= exc.request_ids
            continue
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.token_ids
    return lost


@pytest.fixture(scope="module")
def alone(small_vocab_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy output, decoded alone by a fresh autoregressive engine (greedy
    speculation decodes the same tokens: the exactness tests check it)."""
    eng = _engine(small_vocab_dir, "none", False)
    prompts = [PROMPTS[rid] for rid in ("r2", "r3", "r4")] + [LATE]
    return {tuple(p): eng.generate([p], GREEDY)[0].token_ids for p in prompts}


@pytest.mark.parametrize("queue", ["waiting", "empty"])
@pytest.mark.parametrize("where", ["before_decode", "mid_commit", "after_finish"])
@pytest.mark.parametrize("method", ["none", "tree", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_failed_step_loses_only_its_batch(
    small_vocab_dir: Path, alone: dict[tuple[int, ...], list[int]], method: str, graphs: bool, where: str,
    queue: str,
) -> None:
    eng = _engine(small_vocab_dir, method, graphs)
    idle_blocks = eng.kv_blocks_used
    # Two run. The others wait for a batch slot through the failure, or arrive after it (with
    # nothing waiting, the static path launches each step ahead of its host work).
    early = PROMPTS if queue == "waiting" else {rid: PROMPTS[rid] for rid in ("r0", "r1")}
    for rid, prompt in early.items():
        eng.add_request(rid, prompt, GREEDY)
    finished: dict[str, list[int]] = {}
    for _ in range(2):
        eng.step()
    running = {s.request_id for s in eng.scheduler.running}
    assert running == {"r0", "r1"}
    _inject(eng, where)
    with pytest.raises(StepFailed) as failure:
        while eng.has_unfinished_requests():  # "after_finish" fails in the step where a request ends
            for out in eng.step():
                assert not out.finished or where != "after_finish"
                if out.finished:
                    finished[out.request_id] = out.token_ids
    lost = failure.value.request_ids
    assert lost and lost <= running and not lost & set(finished)
    assert all(eng.sequence(rid) is None for rid in lost)
    zeroed = {event.request_id for event in eng.drain_zero_events()}
    assert lost <= zeroed
    for rid in PROMPTS.keys() - early.keys():
        eng.add_request(rid, PROMPTS[rid], GREEDY)
    assert not _run(eng, finished)
    eng.add_request("late", LATE, GREEDY)
    assert not _run(eng, finished)
    assert set(finished) == {*PROMPTS, "late"} - lost
    for rid in set(finished) - {"late", "r0", "r1"}:
        assert finished[rid] == alone[tuple(PROMPTS[rid])], rid
    assert finished["late"] == alone[tuple(LATE)]
    assert eng.kv_blocks_used == idle_blocks
    free = torch.tensor(sorted(set(range(eng.pool.num_blocks)) - set(eng.pool._owner)))
    assert not eng.pool.kv_cache[:, free].any()  # every freed block zeroed


@pytest.mark.parametrize("where", ["mid_commit", "after_finish"])
@pytest.mark.parametrize("method", ["none", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_a_failed_session_turn_is_rolled_back(small_vocab_dir: Path, method: str, graphs: bool, where: str) -> None:
    first, second, third = [1, 2, 3, 4], [5, 0, 1], [2, 2, 3, 5, 1]

    def turn(eng: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
        eng.add_request(rid, prompt, GREEDY, session_id="s")
        finished: dict[str, list[int]] = {}
        assert not _run(eng, finished)
        return finished[rid]

    eng = _engine(small_vocab_dir, method, graphs)
    idle_blocks = eng.kv_blocks_used
    eng.open_session("s")
    out1 = turn(eng, "t1", first)
    history = eng.session_num_tokens("s")
    eng.add_request("t2", second, GREEDY, session_id="s")
    eng.step()  # its prefill
    _inject(eng, where)
    with pytest.raises(StepFailed) as failure:
        while eng.has_unfinished_requests():
            eng.step()
    assert failure.value.request_ids == {"t2"}
    assert eng.session_num_tokens("s") == history  # the turn never happened
    out3 = turn(eng, "t3", third)
    assert eng.close_session("s") > 0
    assert eng.kv_blocks_used == idle_blocks

    fresh = _engine(small_vocab_dir, method, graphs)
    fresh.open_session("s")
    assert turn(fresh, "t1", first) == out1
    assert turn(fresh, "t3", third) == out3


def test_the_serving_loop_fails_only_the_requests_lost(
    small_vocab_dir: Path, alone: dict[tuple[int, ...], list[int]]
) -> None:
    """Through the serving loop: the first step fails mid-commit; the two requests it ran get
    ``RequestFailed``, the ones waiting in the engine or in the loop's queue are answered."""
    eng = _engine(small_vocab_dir, "tree", True)
    idle_blocks = eng.kv_blocks_used
    loop = EngineLoop(lambda: eng, max_running=4)  # r0-r1 run, r2-r3 wait in the engine, r4 in the loop

    async def serve() -> dict[str, list[int] | None]:
        loop.start()
        assert await asyncio.to_thread(loop.wait_ready, 30)
        await loop.call(lambda engine: _inject(engine, "mid_commit"))
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
    assert answers["r0"] is None and answers["r1"] is None
    for rid in ("r2", "r3", "r4"):
        assert answers[rid] == alone[tuple(PROMPTS[rid])], rid
    assert loop.num_active == 0 and eng.kv_blocks_used == idle_blocks
