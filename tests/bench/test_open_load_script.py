"""scripts/open_load.py: rounds of an open batch, every request served, the adaptive engine's
steps accounted per decode budget."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine import EngineConfig, LLMEngine, SpecConfig
from scripts.open_load import run_round
from tests.model_factory import build_checkpoint


def test_a_round_serves_every_request_and_accounts_its_steps(tmp_path: Path) -> None:
    folder = build_checkpoint(tmp_path / "m", seed=1, vocab_size=16, num_nextn_predict_layers=2)
    eng = LLMEngine.from_pretrained(
        folder, spec=SpecConfig(method="adaptive"), engine_config=EngineConfig(max_batch_size=3)
    )
    args = argparse.Namespace(requests=7, concurrency=3, max_tokens=5, temperature=0.0)
    prompts = [[1, 2, 3, i % 16] for i in range(10)]
    rate, per_budget = run_round(eng, prompts, 0, args)
    assert rate > 0 and not eng.has_unfinished_requests()
    made = sum(int(v[2]) for v in per_budget.values())
    assert 7 <= made <= 7 * 5 and sum(int(v[0]) for v in per_budget.values()) >= 5
