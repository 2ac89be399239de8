"""scripts/seeded_speculation.py: a method's run over prompts one at a time, and seeded
requests' tokens the same under every method."""

from __future__ import annotations

from pathlib import Path

from engine import LLMEngine, SamplingParams, SpecConfig
from scripts.seeded_speculation import run_method
from tests.model_factory import build_checkpoint


def test_seeded_requests_give_one_output_per_prompt_under_every_method(tmp_path: Path) -> None:
    folder = build_checkpoint(tmp_path / "m", seed=1, vocab_size=16, num_nextn_predict_layers=2)
    prompts = [[1, 2, 3, i] for i in range(3)]
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=i, ignore_eos=True) for i in range(3)]
    runs = [run_method(LLMEngine.from_pretrained(folder, spec=SpecConfig(method=m)), prompts, params)
            for m in ("none", "tree")]  # fmt: skip
    assert runs[0].outputs == runs[1].outputs and all(len(o) == 6 for o in runs[0].outputs)
    assert runs[0].accepted_length == 1.0 and runs[1].accepted_length >= 1.0 and runs[1].tokens_per_s > 0
