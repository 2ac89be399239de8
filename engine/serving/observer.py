"""What the engine thread reports, and to whom.

The engine loop calls a :class:`LoopObserver` from its own thread after every scheduler step, so
metric definitions (Prometheus, logs) stay in the HTTP layer and the loop stays testable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class LoopStats:
    """Scheduler occupancy after a step. ``waiting`` counts the loop's queue plus the engine's."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


class LoopObserver(Protocol):
    """Callbacks run on the engine thread; implementations must be thread-safe and quick."""

    def on_admit(self, owner: str, queue_seconds: float) -> None:
        """A request left the loop's waiting queue and was handed to the engine."""

    def on_step(
        self, outputs: Sequence[Any], step_seconds: float, decode_budget: str | None = None
    ) -> None:
        """One ``engine.step()`` returned these ``RequestOutput`` objects; its decode ran with
        draft budget ``decode_budget`` (``none``, ``chain-4``, ``tree-4x6-32``; None: no
        decode)."""

    def on_stats(self, stats: LoopStats) -> None:
        """Occupancy changed (called after each step and after commands)."""

    def on_zero_events(self, events: Sequence[Any]) -> None:
        """KV blocks were zeroed and returned to the pool (``engine.drain_zero_events()``)."""

    def on_step_failed(self, resumed: int, lost: int) -> None:
        """An engine step raised: of its batch, ``resumed`` requests were resumed and ``lost``
        failed (``engine.step_failure``)."""


class NullObserver:
    """Observes nothing."""

    def on_admit(self, owner: str, queue_seconds: float) -> None:
        return None

    def on_step(
        self, outputs: Sequence[Any], step_seconds: float, decode_budget: str | None = None
    ) -> None:
        return None

    def on_stats(self, stats: LoopStats) -> None:
        return None

    def on_zero_events(self, events: Sequence[Any]) -> None:
        return None

    def on_step_failed(self, resumed: int, lost: int) -> None:
        return None
