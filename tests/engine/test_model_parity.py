"""Our DeepSeek-V3 against transformers' on the same random folders (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.batch_builder import SeqRows, build_batch, causal_mask
from tests.model_factory import build_checkpoint


def _reference(folder: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _engine_logits(eng: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill every prompt in one batched forward through the paged cache; logits per prompt."""
    bs = eng.pool.block_size
    rows = []
    for i, p in enumerate(prompts):
        blocks = list(range(i * 8, i * 8 + -(-len(p) // bs)))
        rows.append(SeqRows(blocks, 0, p, list(range(len(p))), causal_mask(len(p))))
    ids, batch = build_batch(rows, bs, eng.device)
    with torch.inference_mode():
        logits = eng.model.logits(eng.model.forward_target(ids, batch, eng.pool.kv_cache))
    return list(logits.split([len(p) for p in prompts]))


CONFIGS = {
    "dense": {},
    "moe_qlora": dict(n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1,
                      q_lora_rank=24, routed_scaling_factor=2.5),
    "yarn": dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=128, beta_fast=32,
                                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "non_interleaved_tied": dict(rope_interleave=False, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_transformers(tmp_path: Path, name: str) -> None:
    folder = build_checkpoint(tmp_path / name, seed=3, **CONFIGS[name])
    ref = _reference(folder)
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="none"))
    prompts = [[3, 9, 27, 81, 50, 2, 7, 7, 13], [4, 5], list(range(10, 40))]
    ours = _engine_logits(eng, prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["dense", "moe_qlora", "yarn"])
def test_greedy_decode_matches_transformers_generate(tmp_path: Path, name: str) -> None:
    folder = build_checkpoint(tmp_path / name, seed=4, **CONFIGS[name])
    ref = _reference(folder)
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="none"))
    prompts = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist()
        assert out.finish_reason == "length"
        assert out.stats.num_steps == 63  # the first token comes from the prefill


def test_decode_logits_through_paged_cache_match_full_forward(dense_model_dir: Path) -> None:
    """Prefill then many single-token steps: each step's logits equal a full recompute."""
    ref = _reference(dense_model_dir)
    eng = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="none"),
                                    )
    eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    seq = eng._requests["r"]
    captured: list[torch.Tensor] = []
    original = eng.model.logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        captured.append(out[-1].clone())
        return out

    eng.model.logits = spy  # type: ignore[method-assign]
    while eng.has_unfinished_requests():
        eng.step()
    tokens = seq.tokens
    with torch.no_grad():
        full = ref(torch.tensor([tokens[:-1]])).logits[0]
    # captured[i] predicts token index 3 + i
    for i, got in enumerate(captured):
        torch.testing.assert_close(got, full[2 + i], rtol=1e-4, atol=1e-4)
