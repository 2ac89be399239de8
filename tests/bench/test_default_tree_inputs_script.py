"""scripts/default_tree_inputs.py h200-latency: the H200 latency model fitted to fixed shapes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.simulator import LatencyModel
from tests.bench.scripts import load_script

FIXED, PER_TOKEN, PER_DEPTH = 0.7e-3, 2e-6, 80e-6


def _shapes_json(path: Path, labels: dict[str, tuple[int, int]]) -> Path:
    def run(label: str, mode: str, ms: float) -> dict:
        return {"label": label, "mode": mode, "batch_size": 1, "temperature": 0.0, "step_ms": ms}

    runs = [run("ar", "ar", 0.69), run("ar", "ar", 9.9) | {"batch_size": 4}]
    for label, (tokens, depth) in labels.items():
        ms = (FIXED + PER_TOKEN * tokens + PER_DEPTH * depth) * 1e3
        runs.append(run(label, "chain" if label == "chain" else "tree", ms))
    path.write_text(json.dumps({"commit": "abc1234", "runs": runs}))
    return path


def test_the_fit_recovers_the_step_costs_of_the_shapes(tmp_path: Path) -> None:
    script = load_script("default_tree_inputs")
    # (tokens verified, depths drafted): the chain arm is CHAIN_DEPTH (4) deep
    shapes = _shapes_json(tmp_path / "shapes.json",
                          {"chain": (5, 4), "tree-4x4-32": (33, 4), "tree-4x6-32": (33, 6), "tree-4x8-40": (41, 8)})  # fmt: skip
    script.extract_h200_latency(argparse.Namespace(shapes=shapes, out_dir=tmp_path))
    written = json.loads((tmp_path / "h200-gpu-latency.json").read_text())
    fit = written["source"]["fit"]
    assert fit == pytest.approx({"fixed": FIXED, "per_token": PER_TOKEN, "per_depth": PER_DEPTH}, rel=1e-6)
    latency = LatencyModel.from_json(tmp_path / "h200-gpu-latency.json")
    assert latency.verify_seconds(1, 1) == pytest.approx(0.69e-3)  # the autoregressive step
    assert latency.verify_seconds(1, 33) == pytest.approx(FIXED + PER_TOKEN * 33)
    assert latency.draft_seconds(1, 4) == pytest.approx(PER_DEPTH)


def test_too_few_shapes_is_a_clear_error(tmp_path: Path) -> None:
    script = load_script("default_tree_inputs")
    shapes = _shapes_json(tmp_path / "shapes.json", {"chain": (5, 4), "tree-4x6-32": (33, 6)})
    with pytest.raises(ValueError, match="need 3 speculative shapes"):
        script.extract_h200_latency(argparse.Namespace(shapes=shapes, out_dir=tmp_path))
