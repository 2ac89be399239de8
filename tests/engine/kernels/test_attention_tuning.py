"""The attention kernel's table of measured launch settings (``engine.kernels.attention_tuning``)
and the pure parts of ``scripts/tune_attention.py`` that fill it (the timing needs a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

from engine.kernels import attention_tuning  # noqa: E402
from engine.kernels.attention_tuning import ShapeKey, TunedLaunch, lookup  # noqa: E402
from engine.kernels.tree_mla_attention import tuned_launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
H200 = "NVIDIA H200"
LAUNCH = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_splits": 1, "pack_heads": False}


def _script() -> object:
    spec = importlib.util.spec_from_file_location("tune_attention", ROOT / "scripts" / "tune_attention.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "tuned.json"
    entry = {"num_seqs": 1, "max_new": 33, "has_qctx": False, "launch": LAUNCH, "us": 5.0, "default_us": 8.0}
    path.write_text(json.dumps({"tables": [
        {"device": H200, "heads": 12, "rank": 256, "rope": 32, "entries": [entry]},
        {"device": "NVIDIA H100", "heads": 12, "rank": 256, "rope": 32,
         "entries": [{**entry, "launch": {**LAUNCH, "num_splits": 4}}]},
    ]}))  # fmt: skip
    monkeypatch.setenv(attention_tuning.ENV_VAR, str(path))
    attention_tuning.clear_cache()
    yield path
    attention_tuning.clear_cache()


def test_a_measured_shape_takes_its_settings_on_its_device_only(table: Path) -> None:
    key = ShapeKey(1, 33, False)
    assert lookup(H200, 12, 256, 32, key) == TunedLaunch(**LAUNCH)
    assert lookup("NVIDIA H100", 12, 256, 32, key) == TunedLaunch(**{**LAUNCH, "num_splits": 4})
    assert lookup(H200, 12, 256, 32, ShapeKey(1, 33, True)) is None  # MTP rows: not measured
    assert lookup(H200, 12, 256, 32, ShapeKey(2, 33, False)) is None
    assert lookup(H200, 128, 512, 64, key) is None  # other model sizes
    assert tuned_launch(None, 12, 256, 32, key) is None  # off a CUDA device: the defaults
    assert tuned_launch(H200, 12, 256, 32, key) == TunedLaunch(**LAUNCH)


def test_no_table_file_means_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(attention_tuning.ENV_VAR, str(tmp_path / "absent.json"))
    attention_tuning.clear_cache()
    assert lookup(H200, 12, 256, 32, ShapeKey(1, 1, False)) is None
    attention_tuning.clear_cache()


def test_the_grid_lists_each_distinct_launch_once() -> None:
    tune = _script()
    one_row = list(tune.settings_grid(ShapeKey(1, 1, False), heads=12))  # type: ignore[attr-defined]
    # 12 or 16 rows: every requested tile clamps to 16 rows, so tiles do not multiply the grid
    assert len(one_row) == len(set(one_row)) == 2 * len(tune.BLOCK_NS) * len(tune.SPLITS)  # type: ignore[attr-defined]
    tree = list(tune.settings_grid(ShapeKey(1, 33, False), heads=16))  # type: ignore[attr-defined]
    assert all(s.pack_heads for s in tree)  # a power-of-two head count: one layout
    assert {s.block_m for s in tree} == set(tune.BLOCK_MS) and {s.num_warps for s in tree} == {4, 8}  # type: ignore[attr-defined]
    shapes = tune.parse_shapes("1:33:0,2:4:1")  # type: ignore[attr-defined]
    assert shapes == [ShapeKey(1, 33, False), ShapeKey(2, 4, True)]


def test_the_defaults_stay_unless_beaten_by_the_margin() -> None:
    tune = _script()
    assert tune.pick({"default": 10.0, "a": 9.8}, "default", 0.03) == "default"  # type: ignore[attr-defined]
    assert tune.pick({"default": 10.0, "a": 9.0, "b": 9.5}, "default", 0.03) == "a"  # type: ignore[attr-defined]


def test_a_new_table_replaces_only_its_own(table: Path) -> None:
    tune = _script()
    new = {"device": H200, "heads": 12, "rank": 256, "rope": 32, "entries": []}
    doc = tune.merge_table(table, new)  # type: ignore[attr-defined]
    assert [t["device"] for t in doc["tables"]] == ["NVIDIA H100", H200]
    assert doc["tables"][1]["entries"] == []
