"""scripts/ar_step_profile.py: greedy and sampled autoregressive steps, timed and profiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_profiles_greedy_and_sampled_steps_on_random_weights(tmp_path: Path) -> None:
    out = tmp_path / "profile"
    proc = subprocess.run(
        [sys.executable, "scripts/ar_step_profile.py", str(out), "--random-preset", "tiny",
         "--device", "cpu", "--batch-sizes", "1,3", "--temperatures", "0,1", "--steps", "3",
         "--methods", "none,adaptive"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "ar_step_profile.json").read_text())
    points = [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    assert [(r["batch"], r["temperature"], r["method"]) for r in rows] == [
        (b, t, m) for b, t in points for m in ("none", "adaptive")]
    assert all(r["ms_per_step"] > 0 for r in rows)
    # Each row says which budgets its timed steps took: the baseline's are all autoregressive.
    assert all(sum(r["arms"].values()) == 3 for r in rows)
    assert all(r["arms"] == {"none": 3} for r in rows if r["method"] == "none")
    tables = (out / "ar_step_profile.txt").read_text()
    assert tables.count("==== none T=") == 4 and tables.count("==== adaptive T=") == 4 and "cProfile" in tables


def test_pins_the_adaptive_engine_to_autoregressive_steps(tmp_path: Path) -> None:
    out = tmp_path / "profile"
    proc = subprocess.run(
        [sys.executable, "scripts/ar_step_profile.py", str(out), "--random-preset", "tiny",
         "--device", "cpu", "--batch-sizes", "2", "--temperatures", "0", "--steps", "3",
         "--methods", "none,adaptive", "--adaptive-autoregressive"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "ar_step_profile.json").read_text())
    assert [r["method"] for r in rows] == ["none", "adaptive"]
    assert all(r["arms"] == {"none": 3} for r in rows)
