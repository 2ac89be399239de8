"""``settle_heap``: the heap alive at start-up frozen, young objects collected less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from engine.gc_tuning import GEN0_THRESHOLD, settle_heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """The process's collector as it was: thresholds, and nothing left frozen."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def _young_collections_while_allocating(count: int) -> int:
    """Collections of the youngest generation while ``count`` lists stay alive."""
    seen: list[int] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            seen.append(1)

    gc.callbacks.append(on_gc)
    try:
        kept = [[i] for i in range(count)]  # tracked containers, alive until the end
        del kept
    finally:
        gc.callbacks.remove(on_gc)
    return len(seen)


def test_settle_heap_freezes_the_heap_and_raises_only_the_youngest_threshold(restored_gc: None) -> None:
    _, gen1, gen2 = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    settle_heap()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (GEN0_THRESHOLD, gen1, gen2)


def test_a_steps_worth_of_objects_no_longer_sets_off_a_collection(restored_gc: None) -> None:
    """The objects a batch-256 step leaves alive for a moment (a few per sequence): several
    collections under CPython's default threshold, none after ``settle_heap``."""
    gc.collect()
    gc.set_threshold(700, 10, 10)
    assert _young_collections_while_allocating(5_000) >= 5
    settle_heap()
    assert _young_collections_while_allocating(5_000) == 0
