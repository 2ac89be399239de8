"""The MTP modules' drafting forward (engine/model/draft_layer.py) on CPU: its absorbed and folded
weights and its kernels' PyTorch forms compute the module's layer-by-layer forward."""

from __future__ import annotations

import torch

from engine.model.draft_layer import DraftLayer
from tests.engine.kernels.draft_cases import check_draft_layer, draft_model


def test_the_drafting_forward_computes_the_mtp_layer_in_float32() -> None:
    err, tol = check_draft_layer("cpu", torch.float32, fused=False)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def test_absorbed_weights_have_the_latent_shapes() -> None:
    model = draft_model("cpu", torch.float32)
    layer = model.mtp_layer(1)
    attn = layer.self_attn
    draft = DraftLayer(layer)
    assert draft.q.shape == (attn.num_heads * (attn.kv_rank + attn.rope_dim), attn.q_lora_rank)
    # The rope rows of each head are q_b_proj's own with the query norm's weight folded in.
    rope_rows = draft.q.view(attn.num_heads, -1, attn.q_lora_rank)[:, attn.kv_rank :]
    own = attn.q_b_proj.weight.view(attn.num_heads, -1, attn.q_lora_rank)[:, attn.nope_dim :]
    assert torch.allclose(rope_rows, own * attn.q_a_layernorm.weight, rtol=1e-6, atol=0)
    # The latent rows map the normalised q_a (before the norm's weight) as q_nope then W_UK would.
    q_a = torch.randn(3, attn.q_lora_rank)
    q_nope = ((q_a * attn.q_a_layernorm.weight) @ attn.q_b_proj.weight.t()).view(3, attn.num_heads, -1)
    q_nope = q_nope[..., : attn.nope_dim]
    w_uk = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_rank)[:, : attn.nope_dim]
    want = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    got = (q_a @ draft.q.t()).view(3, attn.num_heads, -1)[..., : attn.kv_rank]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_layers_without_a_query_lora_or_with_experts_keep_the_layer_path() -> None:
    from engine.model.config import ModelConfig
    from engine.model.deepseek_v3 import DeepseekV3ForCausalLM

    base = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_nextn_predict_layers": 1, "num_attention_heads": 2,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}  # fmt: skip
    no_lora = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict({**base, "first_k_dense_replace": 2}))
    assert not DraftLayer.supports(no_lora.mtp_layer(1))
    moe = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict({
        **base, "q_lora_rank": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}))  # fmt: skip
    assert not DraftLayer.supports(moe.mtp_layer(1))
    lora = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict({**base, "q_lora_rank": 16, "first_k_dense_replace": 2}))
    assert DraftLayer.supports(lora.mtp_layer(1))


def test_the_demo_model_decodes_its_autoregressive_tokens_through_the_drafting_layer() -> None:
    from tests.engine.kernels.draft_cases import check_engine_with_drafting_layer

    code, _ = check_engine_with_drafting_layer("cpu")
    assert code == 0, code
