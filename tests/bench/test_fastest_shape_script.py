"""scripts/fastest_shape.py: the fixed tree of highest median speedup at batch 1, greedy."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script


def _run(label: str, speedup: float, mode: str = "tree", batch: int = 1, temperature: float = 0.0) -> dict:
    return {"mode": mode, "label": label, "batch_size": batch, "temperature": temperature,
            "speedup_vs_ar": speedup, "skipped": None}  # fmt: skip


def test_picks_the_fastest_fixed_tree_at_batch_1_greedy() -> None:
    fastest_shape = load_script("fastest_shape").fastest_shape
    doc = {"runs": [
        _run("ar", 1.0, mode="ar"), _run("chain", 3.0, mode="chain"), _run("tree-32", 2.9),
        _run("tree-4x4-32", 2.4), _run("tree-4x6-32", 2.5), _run("tree-4x8-40", 2.8, batch=2),
        _run("tree-4x5-32", 2.7, temperature=0.7), {**_run("tree-4x4-48", 2.9), "skipped": "time"},
    ]}  # fmt: skip
    # the chain, a default-shape tree, other points and skipped runs do not count
    assert fastest_shape(doc) == "4x6-32"


def test_no_fixed_tree_at_batch_1_is_a_clear_error() -> None:
    fastest_shape = load_script("fastest_shape").fastest_shape
    with pytest.raises(ValueError, match="no fixed TOPKxDEPTH-N tree"):
        fastest_shape({"runs": [_run("tree-4x4-32", 2.0, batch=4)]})
