"""End to end: tree speculation samples exactly the target's joint distribution.

A 4-token vocabulary makes the joint law of the first three generated tokens enumerable
(64 outcomes), computed exactly in float64 from transformers' reference model. The engine's
samples under tree speculation (children drawn from the MTP distribution, multi-draft recursive
rejection sampling) must match it by a chi-square test, and the same test must reject a
deliberately broken residual.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

import engine.spec.verifier as verifier
from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tests.model_factory import build_checkpoint

PROMPT = [1, 2, 3, 0, 2]
TEMPERATURE = 0.8
SAMPLES = 3000


@pytest.fixture(scope="module")
def vocab4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("v4"), seed=11, vocab_size=4,
                            num_nextn_predict_layers=2, eos_token_id=None, bos_token_id=None)


def _exact_joint(folder: Path) -> dict[tuple[int, ...], float]:
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(4), repeat=3):
            ids = torch.tensor([PROMPT + list(seq)])
            logp = torch.log_softmax(ref(ids).logits[0].double() / TEMPERATURE, dim=-1)
            n = len(PROMPT)
            joint[seq] = float(sum(logp[n - 1 + i, seq[i]] for i in range(3)).exp())
    return joint


def _sample(folder: Path) -> Counter[tuple[int, ...]]:
    eng = LLMEngine.from_pretrained(
        folder, spec=SpecConfig(method="tree", topk=2, depth=3, num_draft_tokens=5),
        engine_config=EngineConfig(max_batch_size=256),
    )
    sp = SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
    outs = eng.generate([PROMPT] * SAMPLES, sp)
    assert sum(o.stats.num_accepted_tokens for o in outs) > SAMPLES // 4  # drafts were used
    return Counter(tuple(o.token_ids) for o in outs)


def _p_value(joint: dict[tuple[int, ...], float], counts: Counter[tuple[int, ...]]) -> float:
    keys = sorted(joint)
    expected = [joint[k] * SAMPLES for k in keys]
    observed = [counts.get(k, 0) for k in keys]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def test_tree_sampling_matches_exact_joint(vocab4_dir: Path) -> None:
    joint = _exact_joint(vocab4_dir)
    assert _p_value(joint, _sample(vocab4_dir)) > 1e-3


def test_chi_square_catches_a_broken_residual(vocab4_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    joint = _exact_joint(vocab4_dir)
    # Forget to subtract the draft distribution after a rejection.
    monkeypatch.setattr(verifier, "_residual", lambda p, q: p.clone())
    assert _p_value(joint, _sample(vocab4_dir)) < 1e-6
