"""scripts/batch_change_cost.py: the diagnosis runs and measures the steps whose batch changed."""

from __future__ import annotations

from pathlib import Path

from engine import EngineConfig, LLMEngine, SpecConfig
from tests.bench.scripts import load_script


def test_changed_steps_are_measured_on_the_graphed_path(tmp_path: Path) -> None:
    module = load_script("batch_change_cost")
    folder = module._tiny_checkpoint(tmp_path)
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="chain", num_draft_tokens=4),
                                    engine_config=EngineConfig(max_batch_size=16, cuda_graphs=True))  # fmt: skip
    gathered: list[int] = []
    runner = eng.graphed_tree
    assert runner is not None
    gather = runner._gather_inputs
    runner._gather_inputs = lambda src, dst, to, rows: gathered.append(len(to)) or gather(src, dst, to, rows)  # type: ignore[method-assign]
    split_ms, load_ms = module._measure(eng, 16)
    assert split_ms and load_ms and len(split_ms) == len(load_ms)
    assert gathered, "the changed steps' survivors were gathered on the device"
