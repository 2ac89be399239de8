"""The pure parts of ``scripts/tune_attention.py`` (the timing needs a GPU): the grid of launch
settings it tries, the choice against the defaults, and the shapes it is given."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench.scripts import load_script

pytest.importorskip("triton")


def _script() -> Any:
    return load_script("tune_attention")


def test_the_grid_lists_each_distinct_launch_once() -> None:
    tune = _script()
    grid = tune.Grid(block_ms=(16, 32, 64), block_ns=(16, 32), splits=(1, 2, 4, 8))
    one_row = list(tune.settings_grid(tune.ShapeKey(1, 1, False), 12, grid))
    # 12 or 16 rows: every requested tile clamps to 16 rows, so tiles do not multiply the grid
    assert len(one_row) == len(set(one_row)) == 2 * 2 * 4  # layouts x keys x splits
    assert {s.block_m for s in one_row} == {16} and {s.pack_heads for s in one_row} == {True, False}
    tree = list(tune.settings_grid(tune.ShapeKey(1, 33, False), 16, grid))
    assert all(s.pack_heads for s in tree)  # a power-of-two head count: one layout
    assert {s.block_m for s in tree} == {16, 32, 64} and {s.num_warps for s in tree} == {4, 8}
    assert {s.num_warps for s in tree if s.block_m < 64} == {4}  # 8 warps only for 64-row tiles


def test_the_defaults_stay_unless_beaten_by_the_margin() -> None:
    tune = _script()
    assert tune.pick({"default": 10.0, "a": 9.8}, "default", 0.03) == "default"
    assert tune.pick({"default": 10.0, "a": 9.0, "b": 9.5}, "default", 0.03) == "a"
    assert tune.pick({"default": 10.0, "a": 10.5}, "default", 0.0) == "default"


def test_shapes_given_on_the_command_line() -> None:
    tune = _script()
    assert tune.parse_shapes("1:33:0,2:4:1") == [tune.ShapeKey(1, 33, False), tune.ShapeKey(2, 4, True)]
