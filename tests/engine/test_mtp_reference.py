"""The published layout (61 layers + one MTP module at layer 61) against transformers' own MTP.

transformers reads MTP weights at layer 61 only and builds that layer as MoE, so this layout is
where its ``MtpModel`` and ``generate(..., use_mtp=True)`` are an independent reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.model.loader import load_model
from tests.model_factory import build_checkpoint


@pytest.fixture(scope="module")
def published_layout_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        tmp_path_factory.mktemp("l61"), seed=2, num_hidden_layers=61, num_nextn_predict_layers=1,
        n_routed_experts=4, first_k_dense_replace=3, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=16,
    )


def test_mtp_module_matches_transformers_mtp_layer(published_layout_dir: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(published_layout_dir, dtype=torch.float32).eval()
    mtp = MtpModel.from_pretrained(ref).eval()
    ours = load_model(published_layout_dir)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        h_ref = ref(ids, output_hidden_states=True).hidden_states[-1]
        h_ours = ours.forward_train(ids)
        torch.testing.assert_close(h_ours, h_ref, rtol=1e-4, atol=1e-4)
        positions = torch.arange(1, 10)[None]
        want = mtp.forward_layer(0, h_ref[:, :-1], positions, None, input_ids=ids[:, 1:])
        got = ours.mtp_forward_train(1, h_ours[:, :-1], ids[:, 1:])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_chain_equals_transformers_mtp_generation(published_layout_dir: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(published_layout_dir, dtype=torch.float32).eval()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, use_mtp=True,
                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for spec in (SpecConfig(method="none"), SpecConfig(method="chain"), SpecConfig(method="tree")):
        out = LLMEngine.from_pretrained(published_layout_dir, spec=spec).generate([prompt], sp)[0]
        assert out.token_ids == want, spec.method
