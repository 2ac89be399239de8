"""The engine thread: the only code that ever touches an ``LLMEngine``.

The engine is not thread-safe, so one thread owns it: it builds the engine, takes commands
(submissions, aborts, session calls) from a thread-safe queue, admits waiting requests, calls
``engine.step()`` and hands each request's outputs to that request's asyncio queue with
``loop.call_soon_threadsafe``. Commands are run before every step, so an abort (a client that
went away) frees and zeroes the request's KV blocks before the next step.

Terms:
  - *queued*: submitted, waiting in this loop's bounded queue (not yet given to the engine);
  - *admitted*: handed to ``engine.add_request`` (the engine may still hold it in its own
    waiting list; the loop keeps at most ``max_running`` requests inside the engine);
  - *active*: queued or admitted and not finished; what a drain waits for.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.gc_tuning import settle_heap
from engine.serving.observer import LoopObserver, LoopStats, NullObserver
from engine.serving.request_stream import (
    LoopClosed,
    QueueFull,
    RequestFailed,
    RequestStream,
    StepOutput,
)
from engine.step_failure import StepFailed

log = logging.getLogger("mtpserve.engine_loop")
# Failed steps in a row with no request in their batch (the engine failing on its own, before
# any request ran) after which the loop gives the engine up (``EngineLoop.fault``).
MAX_UNATTRIBUTED_FAILURES = 2
T = TypeVar("T")


@dataclass
class _Queued:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Any
    session_id: str | None
    owner: str
    stream: RequestStream
    submitted_at: float


class EngineLoop:
    """Runs ``engine_factory()`` and then the step loop on a dedicated thread."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        *,
        max_waiting: int = 256,
        max_running: int = 64,
        observer: LoopObserver | None = None,
        idle_poll_s: float = 0.02,
        freeze_gc: bool = False,
    ) -> None:
        self._factory = engine_factory
        # Once the engine is built, move every object alive (imports, model, CUDA graphs) out
        # of the cyclic GC's reach: a full collection over them took milliseconds, and it ran
        # in the step loop every few hundred steps. For a process that serves one engine.
        self._freeze_gc = freeze_gc
        self._max_waiting = max_waiting
        self._max_running = max_running
        self._observer: LoopObserver = observer or NullObserver()
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._queued: deque[_Queued] = deque()  # loop thread only
        self._streams: dict[str, RequestStream] = {}  # loop thread only: admitted requests
        self._lock = threading.Lock()
        self._num_queued = 0
        self._num_active = 0
        self._closed = False
        self._stop_requested = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine", daemon=True)
        self._engine: Any = None
        self.load_error: BaseException | None = None
        self.fault: BaseException | None = None  # a step the engine could not recover from
        self._unattributed = 0  # failed steps in a row that had no request in them
        self.accepting = False
        self.stats = LoopStats(0, 0, 0, 0)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is built (or failed to build); True when it is ready."""
        self._ready.wait(timeout)
        return self.ready

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.load_error is None and self.fault is None and self.alive

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def engine(self) -> Any:
        """The engine, for its immutable attributes only (tokenizer, eos_token_ids,
        max_model_len). Everything else goes through :meth:`call` on the loop thread."""
        if not self.ready:
            raise LoopClosed("the engine is not loaded")
        return self._engine

    @property
    def num_active(self) -> int:
        return self._num_active

    async def drain(self, timeout: float) -> int:
        """Stop accepting, wait up to ``timeout`` seconds for active requests, abort the rest.

        Returns the number of requests that had to be aborted.
        """
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._num_active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = self._num_active
        if left and self.alive:
            await self.call(lambda _engine: self._abort_all())
        return left

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish (after running the commands already queued) and join it."""
        self.accepting = False
        if self._thread.is_alive():
            self._put(self._request_stop)
            self._thread.join(timeout)

    # ----------------------------------------------------------------- async API
    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Any,
        *,
        session_id: str | None = None,
        owner: str = "",
    ) -> RequestStream:
        """Queue a request. Raises LoopClosed (not accepting) or QueueFull at once; engine
        validation errors (``ValueError``) arrive through ``await stream.admitted``."""
        if not self.accepting or not self.ready:
            raise LoopClosed("the server is not accepting requests")
        with self._lock:
            if self._num_queued >= self._max_waiting:
                raise QueueFull(f"the waiting queue is full ({self._max_waiting} requests)")
            self._num_queued += 1
            self._num_active += 1
        stream = RequestStream(request_id, asyncio.get_running_loop())
        item = _Queued(
            request_id,
            list(prompt_token_ids),
            sampling,
            session_id,
            owner,
            stream,
            time.monotonic(),
        )
        try:
            self._put(lambda: self._queued.append(item))
        except LoopClosed:
            self._count(queued=-1, active=-1)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its KV is freed and zeroed before the next step."""
        try:
            self._put(lambda: self._abort(request_id))
        except LoopClosed:
            pass

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the loop thread (between steps) and return its result."""
        if self._engine is None or not self._thread.is_alive():
            raise LoopClosed("the engine is not running")
        aio_loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = aio_loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def run() -> None:
            try:
                result, error = fn(self._engine), None
            except Exception as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            # Audit KV zeroing (a closed session) before the caller sees the result.
            self._flush_zero_events()
            try:
                aio_loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # event loop already closed
                pass

        self._put(run)
        return await future

    # ----------------------------------------------------------------- loop thread
    def _put(self, command: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise LoopClosed("the engine loop has stopped")
            self._commands.put(command)

    def _count(self, *, queued: int = 0, active: int = 0) -> None:
        with self._lock:
            self._num_queued += queued
            self._num_active += active

    def _request_stop(self) -> None:
        self._stop_requested = True

    def _run(self) -> None:
        try:
            self._engine = self._factory()
        except BaseException as exc:  # reported through load_error and /ready
            log.exception("engine failed to load")
            self.load_error = exc
            with self._lock:
                self._closed = True
            self._ready.set()
            return
        if self._freeze_gc:
            settle_heap()
        self.accepting = True
        self._ready.set()
        try:
            while not self._stop_requested:
                busy = self.fault is None and (bool(self._queued) or self._engine.has_unfinished_requests())
                self._run_commands(block=not busy)
                if self._stop_requested:
                    break
                if self.fault is None:
                    self._admit()
                    if self._engine.has_unfinished_requests():
                        self._step()
                else:  # a failed engine takes no more work (``_fault``)
                    self._fail_queued()
                self._after_work()
        except Exception:
            log.exception("engine loop crashed")
        finally:
            self._shutdown()

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_poll_s) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        engine = self._engine
        while self._queued and engine.num_running + engine.num_waiting < self._max_running:
            item = self._queued.popleft()
            self._count(queued=-1)
            try:
                engine.add_request(
                    item.request_id,
                    item.prompt_token_ids,
                    item.sampling,
                    session_id=item.session_id,
                    owner=item.owner,
                )
            except ValueError as exc:  # the client's input: becomes a 4xx
                self._count(active=-1)
                item.stream.set_admitted(exc)
                continue
            except Exception:
                log.exception("add_request failed")
                self._count(active=-1)
                item.stream.set_admitted(RequestFailed("the engine could not take the request"))
                continue
            self._streams[item.request_id] = item.stream
            item.stream.set_admitted(None)
            self._observer.on_admit(item.owner, time.monotonic() - item.submitted_at)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self._engine.step()
        except StepFailed as exc:
            # The engine parked the step's batch and is ready for the next step. Each request of
            # it resumes from what its client has received (once; then it runs alone until it
            # has decoded a step), or fails if it had been resumed before; the others, waiting
            # in the engine or in this loop's queue, carry on.
            log.error("%s", exc, exc_info=exc.__cause__)
            self._unattributed = 0 if exc.request_ids else self._unattributed + 1
            if self._unattributed >= MAX_UNATTRIBUTED_FAILURES:
                # Steps that fail with no request in them, one after another: the engine
                # itself is failing, and no request would ever run again.
                self._fault(exc)
                return
            lost = [rid for rid in exc.request_ids if not self._resume(rid)]
            if lost:
                log.error("requests failed after a failed step: %s", ", ".join(sorted(lost)))
                self._fail(lost, RequestFailed("the engine failed while generating"))
            self._observer.on_step_failed(len(exc.request_ids) - len(lost), len(lost))
            return
        except Exception as exc:
            # Not a step the engine recovered from (``StepFailed``): its recovery failed too (a
            # sticky device error), and its state is unknown.
            log.exception("engine step failed and the engine did not recover")
            self._fault(exc)
            return
        self._unattributed = 0
        self._observer.on_step(outputs, time.perf_counter() - started, self._engine.last_decode_budget)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            item = StepOutput.from_engine(out)
            stream.num_delivered = item.num_generated
            stream.deliver(item)
            if out.finished:
                del self._streams[out.request_id]
                self._count(active=-1)

    def _fault(self, exc: BaseException) -> None:
        """The engine cannot go on: every request in it fails, and the loop stops accepting
        (``ready`` turns false; the server exits to be restarted)."""
        self.fault = exc
        self.accepting = False
        self._observer.on_step_failed(0, len(self._streams))
        self._fail(list(self._streams), RequestFailed("the engine failed while generating"))
        self._fail_queued()

    def _fail_queued(self) -> None:
        """Fail the requests queued here (never admitted), as admission into a failed engine
        would; those submitted just before the fault arrive after it, and fail on the next turn."""
        for item in self._queued:
            item.stream.set_admitted(RequestFailed("the engine failed"))
            self._count(queued=-1, active=-1)
        self._queued.clear()

    def _resume(self, request_id: str) -> bool:
        """Resume a request of a failed step from what its stream delivered; False if it may
        not be (resumed before, or no longer served)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        try:
            return bool(self._engine.resume_request(request_id, stream.num_delivered))
        except Exception:
            log.exception("resume_request failed")
            return False

    def _after_work(self) -> None:
        self._flush_zero_events()
        engine = self._engine
        stats = LoopStats(
            running=engine.num_running,
            waiting=len(self._queued) + engine.num_waiting,
            kv_blocks_used=engine.kv_blocks_used,
            kv_blocks_total=engine.kv_blocks_total,
        )
        if stats != self.stats:
            self.stats = stats
            self._observer.on_stats(stats)

    def _flush_zero_events(self) -> None:
        events = self._engine.drain_zero_events()
        if events:
            self._observer.on_zero_events(events)

    def _abort(self, request_id: str) -> None:
        for item in self._queued:
            if item.request_id == request_id:
                self._queued.remove(item)
                self._count(queued=-1, active=-1)
                item.stream.set_admitted(LoopClosed("aborted"))
                return
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._count(active=-1)
        try:
            self._engine.abort_request(request_id)
        except Exception:
            log.exception("abort_request failed")
        stream.deliver(StepOutput.aborted(request_id))

    def _abort_all(self) -> None:
        for item in list(self._queued):
            self._abort(item.request_id)
        for request_id in list(self._streams):
            self._abort(request_id)

    def _fail(self, request_ids: Iterable[str], error: BaseException) -> None:
        """Fail these admitted requests: out of the engine (their KV freed and zeroed), the error
        to their streams."""
        for request_id in request_ids:
            try:
                self._engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request failed")
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.deliver(error)
                self._count(active=-1)

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self.accepting = False
        # Run what was queued before the stop (session closes zero memory), then fail the rest.
        self._run_commands(block=False)
        closed = LoopClosed("the server is shutting down")
        for item in self._queued:
            item.stream.set_admitted(closed)
            self._count(queued=-1, active=-1)
        self._queued.clear()
        if self._engine is not None:
            self._fail(list(self._streams), closed)
            self._flush_zero_events()
