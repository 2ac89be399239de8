"""The engine thread: sole owner of the engine, bounded queue, aborts, drain."""

from __future__ import annotations

import asyncio

import pytest

from engine.params import SamplingParams
from engine.serving import EngineLoop, LoopClosed, QueueFull, RequestFailed
from tests.app.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio


async def _ready(loop: EngineLoop) -> None:
    loop.start()
    assert await asyncio.to_thread(loop.wait_ready, 5)


async def test_only_the_loop_thread_touches_the_engine() -> None:
    engine = FakeEngine()
    loop = EngineLoop(lambda: engine)
    await _ready(loop)
    streams = [
        await loop.submit(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(5)
    ]
    for stream in streams:
        await stream.admitted
        total = 0
        while True:
            out = await stream.get()
            total += len(out.new_token_ids)
            if out.finished:
                break
        assert total == 8
    await loop.call(lambda eng: eng.open_session("s", "t"))
    assert len(engine.thread_ids) == 1 and loop._thread.ident in engine.thread_ids
    loop.stop()
    assert not loop.alive
    with pytest.raises(LoopClosed):
        await loop.submit("late", [1], SamplingParams())


async def test_bounded_queue_and_abort_of_queued_request() -> None:
    engine = FakeEngine(step_delay_s=0.05)
    loop = EngineLoop(lambda: engine, max_waiting=1, max_running=1)
    await _ready(loop)
    first = await loop.submit("a", [1], SamplingParams(max_tokens=50))
    await first.admitted
    queued = await loop.submit("b", [1], SamplingParams(max_tokens=5))
    with pytest.raises(QueueFull):
        await loop.submit("c", [1], SamplingParams(max_tokens=5))
    loop.abort("b")
    with pytest.raises(LoopClosed):
        await queued.admitted
    loop.abort("a")
    for _ in range(200):
        if loop.num_active == 0 and engine.kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert loop.num_active == 0 and engine.kv_blocks_used == 0
    loop.stop()


async def test_engine_value_error_arrives_at_admission() -> None:
    loop = EngineLoop(FakeEngine)
    await _ready(loop)
    stream = await loop.submit("bad", [10_000], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        await stream.admitted
    assert loop.num_active == 0
    loop.stop()


async def test_drain_waits_then_aborts_the_rest() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    loop = EngineLoop(lambda: engine)
    await _ready(loop)
    quick = await loop.submit("q", [1], SamplingParams(max_tokens=2))
    slow = await loop.submit("s", [1], SamplingParams(max_tokens=400))
    aborted = await loop.drain(timeout=0.3)
    assert aborted == 1 and loop.num_active == 0
    assert quick.finished or (await quick.get()) is not None
    reasons = []
    while not slow.finished:
        reasons.append((await slow.get()).finish_reason)
    assert reasons[-1] == "abort"
    loop.stop()


async def test_load_failure_is_reported() -> None:
    def broken() -> FakeEngine:
        raise FileNotFoundError("no model")

    loop = EngineLoop(broken)
    loop.start()
    assert not await asyncio.to_thread(loop.wait_ready, 5)
    assert isinstance(loop.load_error, FileNotFoundError)
    with pytest.raises(LoopClosed):
        await loop.submit("x", [1], SamplingParams())


async def test_the_server_exits_when_the_engine_cannot_recover() -> None:
    """``mtpserve serve`` exits with code 1 (its supervisor restarts it) once the engine loop has
    a fault, as it does when the model fails to load."""
    from types import SimpleNamespace

    from app.server import _watch_engine

    loop = SimpleNamespace(load_error=None, ready=True, fault=None)
    service = SimpleNamespace(loop=loop, model_name="m")
    stop, exit_code = asyncio.Event(), [0]
    watcher = asyncio.create_task(_watch_engine(service, stop, exit_code, poll_s=0.01))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not stop.is_set()
    loop.fault = RuntimeError("sticky device error")
    await asyncio.wait_for(stop.wait(), 1)
    assert exit_code == [1]
    await watcher


async def test_an_engine_that_cannot_recover_fails_every_request_and_takes_no_more() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    loop = EngineLoop(lambda: engine, max_running=1)
    await _ready(loop)
    running = await loop.submit("a", [1], SamplingParams(max_tokens=50))
    await running.admitted
    queued = await loop.submit("b", [1], SamplingParams(max_tokens=5))
    engine.break_next_step = True
    with pytest.raises(RequestFailed):
        while not (await running.get()).finished:
            pass
    with pytest.raises(RequestFailed):
        await queued.admitted
    assert loop.fault is not None and not loop.ready and loop.num_active == 0
    with pytest.raises(LoopClosed):
        await loop.submit("c", [1], SamplingParams())
    loop.stop()
