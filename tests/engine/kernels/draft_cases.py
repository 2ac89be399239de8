"""The drafting forward's pieces against their references, on CPU and on the GPU.

- ``check_fused_linear(name, device)``: ``fused_linear`` (Triton; interpreted on CPU) against
  ``fused_linear_torch``, which is checked against plain PyTorch ops first on the weights
  before ``fold_norm`` / ``interleave_gate_up`` (norm, residual, SwiGLU, a strided input).
- ``check_draft_layer(device, dtype, fused)``: ``DraftLayer.forward`` (its GEMMs as Triton
  kernels or as ``fused_linear_torch``) against the model's own
  layer-by-layer MTP forward (``forward_mtp_fused``) on random weights and a paged cache with
  committed entries: the hidden states and every cache entry written.

Each returns ``(relative max error, tolerance)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# name -> (dtype, M, N, K, norm, residual, gated, strided input)
LINEAR_CASES: dict[str, tuple[torch.dtype, int, int, int, bool, bool, bool, bool]] = {
    "fp32_plain": (torch.float32, 5, 40, 72, False, False, False, False),
    "fp32_norm_strided": (torch.float32, 17, 24, 150, True, False, False, True),
    "fp32_residual_k_tail": (torch.float32, 3, 33, 200, False, True, False, False),
    "fp32_norm_gated": (torch.float32, 9, 48, 64, True, False, True, False),
    "fp16_norm_gated_residual": (torch.float16, 40, 80, 96, True, True, True, False),
}
# bfloat16 only compiled (the interpreter's tl.dot mishandles it): the gpu preset's shapes.
GPU_LINEAR_CASES: dict[str, tuple[torch.dtype, int, int, int, bool, bool, bool, bool]] = {
    "bf16_qkv_a_norm": (torch.bfloat16, 8, 672, 768, True, False, False, False),
    "bf16_q_norm_strided": (torch.bfloat16, 40, 3456, 384, True, False, False, True),
    "bf16_o_residual": (torch.bfloat16, 264, 768, 3072, False, True, False, False),
    "bf16_gate_up": (torch.bfloat16, 8, 2048, 768, True, False, True, False),
    "bf16_down_residual": (torch.bfloat16, 1000, 768, 2048, False, True, False, False),
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def check_fused_linear(name: str, device: str) -> tuple[float, float]:
    from engine.kernels.fused_linear import fused_linear
    from engine.model.draft_layer import fold_norm, fused_linear_torch, interleave_gate_up

    dtype, M, N, K, norm, residual, gated, strided = {**LINEAR_CASES, **GPU_LINEAR_CASES}[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    wide = torch.randn(M, K + 7, generator=gen) * 3
    x = wide[:, 3 : 3 + K] if strided else wide[:, :K].contiguous()  # [M, K]
    gate, up = torch.randn(2, N, K, generator=gen) / K**0.5
    norm_w = torch.rand(K, generator=gen) + 0.5
    res = torch.randn(M, N, generator=gen) if residual else None
    # Plain ops on CPU in float32: what the kernel's weight layout must compute.
    h = F.rms_norm(x, (K,), eps=1e-6) * norm_w if norm else x
    y = F.silu(h @ gate.t()) * (h @ up.t()) if gated else h @ gate.t()
    y = y + res if res is not None else y
    weight = interleave_gate_up(gate, up) if gated else gate
    weight = fold_norm(weight, norm_w) if norm else weight
    eps = 1e-6 if norm else None
    err = _rel(fused_linear_torch(x, weight, eps, res, gated), y)
    on = {"device": device, "dtype": dtype}
    x_dev = (wide.to(**on)[:, 3 : 3 + K]) if strided else x.to(**on)  # type: ignore[arg-type]
    args = (weight.to(**on), eps, None if res is None else res.to(**on), gated)  # type: ignore[arg-type]
    want = fused_linear_torch(x_dev, *args)
    got = fused_linear(x_dev, *args)
    return max(err, _rel(got, want)), _tol(dtype)


def _draft_model(device: str, dtype: torch.dtype) -> torch.nn.Module:
    from engine.model.config import ModelConfig
    from engine.model.deepseek_v3 import DeepseekV3ForCausalLM

    cfg = ModelConfig.from_hf_dict({
        "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 1, "num_nextn_predict_layers": 1, "num_attention_heads": 3,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
        "v_head_dim": 24, "rope_interleave": True, "first_k_dense_replace": 2,
    })  # fmt: skip
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.to(device=device, dtype=dtype).eval()


def check_draft_layer(device: str, dtype: torch.dtype, fused: bool) -> tuple[float, float]:
    """Two sequences (5 and 9 committed entries, 3 and 2 new rows under a tree mask; the
    second's rows hide its last committed entry, as deep MTP rows do) through both forwards."""
    from engine.model.attention_batch import AttentionBatch
    from engine.model.draft_layer import DraftLayer

    model = _draft_model(device, dtype)
    layer = model.mtp_layer(1)
    assert DraftLayer.supports(layer)
    gen = torch.Generator().manual_seed(11)
    entry = layer.self_attn.kv_rank + layer.self_attn.rope_dim
    cache = (torch.randn(1 + model.config.num_hidden_layers, 4, 8, entry, generator=gen) * 0.5).to(device, dtype)
    on = {"device": device}
    batch = AttentionBatch(
        positions=torch.tensor([5, 6, 6, 9, 10], **on),
        slot_mapping=torch.tensor([5, 6, 7, 25, 26], **on),  # seq 0 in block 0, seq 1 in blocks 2-3
        block_tables=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32, **on),
        ctx_lens=torch.tensor([5, 9], dtype=torch.int32, **on),
        query_start=torch.tensor([0, 3, 5], dtype=torch.int32, **on),
        new_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool, **on),
        query_ctx_lens=torch.tensor([5, 5, 5, 8, 8], dtype=torch.int32, **on),
    )
    x = (torch.randn(5, model.config.hidden_size, generator=gen) * 2).to(device, dtype)
    layer_index = model.mtp_cache_layer(1)
    want_cache = cache.clone()
    with torch.inference_mode():
        want = model.forward_mtp_fused(1, x, batch, want_cache)
        batch_again = AttentionBatch(**{k: getattr(batch, k) for k in (
            "positions", "slot_mapping", "block_tables", "ctx_lens", "query_start", "new_mask",
            "query_ctx_lens")})  # a fresh memo  # fmt: skip
        got = DraftLayer(layer).forward(x, model.rope, batch_again, cache[layer_index], fused=fused)
    err = max(_rel(got, want), _rel(cache, want_cache))
    return err, 1e-4 if dtype == torch.float32 else 4e-2
