"""scripts/closed_round_ops.py: an adaptive engine that decodes a closed batch
autoregressively issues the baseline's device ops step by step, and little more host work."""

from __future__ import annotations

import pytest
import torch

from engine.spec.adaptive import NO_SPEC
from scripts.closed_round_ops import count_round, engines


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_an_adaptive_engine_decoding_autoregressively_issues_the_baselines_ops(temperature: float) -> None:
    engs = engines("tiny", batch=16, chunk=512)  # 16 prompts of 64 tokens: 2 filling steps
    vocab = engs["none"].model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (64,), generator=gen).tolist() for _ in range(16)]
    for eng in engs.values():
        count_round(eng, prompts, 4, temperature)  # warm-up: first calls build plans and caches
    base, adaptive = (count_round(engs[m], prompts, 10, temperature) for m in ("none", "adaptive"))
    controller = engs["adaptive"].adaptive
    assert controller is not None and list(controller.steps_per_arm) == [NO_SPEC]  # it chose no drafting
    assert [s["kind"] for s in adaptive] == [s["kind"] for s in base]
    assert {s["kind"] for s in base} == {"filling", "steady", "shrinking"}
    assert [s["ops"] for s in adaptive] == [s["ops"] for s in base]  # the same device work
    extra = sum(s["calls"] for s in adaptive) / sum(s["calls"] for s in base) - 1
    assert 0 <= extra < 0.05, f"the adaptive round made {extra:.1%} more Python calls"
