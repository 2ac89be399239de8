"""End to end: tree speculation samples exactly the target's joint distribution.

A 4-token vocabulary makes the joint law of the first three generated tokens enumerable
(64 outcomes), computed exactly in float64 from transformers' reference model. The engine's
samples under tree speculation (children drawn from the MTP distribution, multi-draft recursive
rejection sampling) must match it by a chi-square test, and the same test must reject a
deliberately broken residual. Both implementations are tested: the host-driven verifier
(``engine.spec.verifier``) and the device-resident step (``engine.spec.graphed_sampled``, the
CUDA-graph code run eagerly on CPU), which draws from the default generator.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

import engine.spec.device_tree as device_tree
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


def _filtered(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # [V] -> [V]
    """OpenAI's top-k then top-p on one law, written out: the ``top_k`` most likely tokens
    (ties to the lower id), renormalised; then, in that order, each token whose mass before it
    is below ``top_p`` (the first always), renormalised."""
    order = sorted(range(len(probs)), key=lambda t: (-float(probs[t]), t))[: top_k or len(probs)]
    mass = sum(float(probs[t]) for t in order)
    kept, before = [], 0.0
    for t in order:
        if before < top_p or not kept:
            kept.append(t)
        before += float(probs[t]) / mass
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def _exact_joint(folder: Path, top_k: int = 0, top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(4), repeat=3):
            ids = torch.tensor([PROMPT + list(seq)])
            probs = torch.softmax(ref(ids).logits[0].double() / TEMPERATURE, dim=-1)  # [T, 4]
            n = len(PROMPT)
            joint[seq] = float(torch.tensor([_filtered(probs[n - 1 + i], top_k, top_p)[seq[i]]
                                             for i in range(3)]).prod())  # fmt: skip
    return joint


def _sample(folder: Path, graphed: bool = False, top_k: int = 0, top_p: float = 1.0) -> Counter[tuple[int, ...]]:
    eng = LLMEngine.from_pretrained(
        folder, spec=SpecConfig(method="tree", topk=2, depth=3, num_draft_tokens=5),
        engine_config=EngineConfig(max_batch_size=256, cuda_graphs=graphed),
    )
    calls: list[int] = []
    if graphed:
        assert eng.graphed_sampled is not None
        run = eng.graphed_sampled.run
        eng.graphed_sampled.run = lambda seqs, *a: calls.append(len(seqs)) or run(seqs, *a)  # type: ignore[method-assign]
    torch.manual_seed(5)  # the device step draws from the default generator
    sp = SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True, top_k=top_k, top_p=top_p)
    outs = eng.generate([PROMPT] * SAMPLES, sp)
    assert sum(o.stats.num_accepted_tokens for o in outs) > SAMPLES // 4  # drafts were used
    assert bool(calls) == graphed  # the device step served the decode steps it was built for
    return Counter(tuple(o.token_ids) for o in outs)


def _p_value(joint: dict[tuple[int, ...], float], counts: Counter[tuple[int, ...]]) -> float:
    if any(n for k, n in counts.items() if not joint.get(k)):
        return 0.0  # an outcome the filters rule out
    keys = sorted(k for k in joint if joint[k] > 0)
    expected = [joint[k] * SAMPLES for k in keys]
    observed = [counts.get(k, 0) for k in keys]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize("graphed", [False, True], ids=["host", "device"])
def test_tree_sampling_matches_exact_joint(vocab4_dir: Path, graphed: bool) -> None:
    joint = _exact_joint(vocab4_dir)
    assert _p_value(joint, _sample(vocab4_dir, graphed)) > 1e-3


@pytest.mark.parametrize("graphed", [False, True], ids=["host", "device"])
def test_tree_sampling_with_top_k_and_top_p_matches_the_filtered_joint(vocab4_dir: Path, graphed: bool) -> None:
    # top-k 3 drops a token at every position; top-p 0.8 then drops more where two tokens
    # already hold 80% of the rest. Drafts are drawn from the filtered MTP law and verified
    # against the filtered target law (the fused kernel on a GPU, the torch ops here).
    joint = _exact_joint(vocab4_dir, top_k=3, top_p=0.8)
    assert sum(1 for v in joint.values() if v == 0) > 32  # the filters rule out many outcomes
    counts = _sample(vocab4_dir, graphed, top_k=3, top_p=0.8)
    assert _p_value(joint, counts) > 1e-3
    assert _p_value(_exact_joint(vocab4_dir), counts) < 1e-6  # the unfiltered law is told apart


@pytest.mark.parametrize("graphed", [False, True], ids=["host", "device"])
def test_chi_square_catches_a_broken_residual(
    vocab4_dir: Path, monkeypatch: pytest.MonkeyPatch, graphed: bool
) -> None:
    joint = _exact_joint(vocab4_dir)
    # Forget to subtract the draft distribution after a rejection.
    monkeypatch.setattr(verifier, "_residual", lambda p, q: p.clone())
    monkeypatch.setattr(device_tree, "residual", lambda p, q: p.clone())
    assert _p_value(joint, _sample(vocab4_dir, graphed)) < 1e-6
