"""An engine's start-up, stage by stage (``LLMEngine.startup_seconds``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SpecConfig


def test_every_start_up_stage_is_timed_and_logged(small_vocab_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.startup_timer"):
        eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"),
                                        engine_config=EngineConfig(cuda_graphs=True))  # fmt: skip
    stages = eng.startup_seconds
    trees = [name for name in stages if name.startswith("tree_graphs:")]
    on_gpu = ["sampling_kernels"] if eng.device.type == "cuda" else []  # compiled before a request
    assert list(stages)[:4 + len(on_gpu)] == ["load_weights", "kv_pool", *on_gpu, "target_graphs", "catch_up_graphs"]
    assert len(trees) == 2 and "tree_graphs:chain-4" in trees  # the engine's tree and the chain arm
    assert list(stages)[-1] == "calibration"
    assert all(v >= 0 for v in stages.values())
    logged = [r.getMessage() for r in caplog.records]
    assert all(any(f"start-up: {name} took" in m for m in logged) for name in stages), logged
    plain = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    assert list(plain.startup_seconds) == ["load_weights", "kv_pool", *on_gpu]  # no graphs, no drafting
