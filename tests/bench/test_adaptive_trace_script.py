"""scripts/adaptive_trace.py: the trace runs on the demo model, and a step during which
something that can stall it happened (``bench.stall_probe``) carries the mark."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.stall_probe import StallProbe
from tests.bench.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "adaptive_trace.py"


def _script() -> object:
    return load_script("adaptive_trace")


def test_a_step_during_a_collection_is_marked() -> None:
    module = _script()

    class Engine:
        device = torch.device("cpu")

        def __init__(self, collect: bool) -> None:
            self.collect = collect

        def step(self) -> list[SimpleNamespace]:
            if self.collect:
                gc.collect()
            # One sequence decoded, another got its first token: the step also prefilled (F).
            return [SimpleNamespace(step_drafted=1), SimpleNamespace(step_drafted=None)]

    with StallProbe() as probe:
        trace: list[str] = []
        for collect in (False, True):
            eng = Engine(collect)
            module._timed(eng, trace, probe)  # type: ignore[attr-defined]
            eng.step()
    assert "[" not in trace[0] and trace[0].startswith("F1:")
    assert trace[1].startswith("F1:") and "[gc " in trace[1], trace


def test_the_trace_runs_on_the_demo_model() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(ROOT / "models" / "demo"), "--device", "cpu",
         "--batch-sizes", "2", "--temperatures", "0", "--rounds", "1", "--max-new-tokens", "6"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "T=0.0 b=2 round 1: speedup" in out and "    adaptive: P2" in out and "    ar:       P2" in out, out
