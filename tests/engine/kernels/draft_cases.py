"""The drafting forward's pieces against their references, on CPU and on the GPU.

- ``check_draft_rope`` / ``check_scaled_silu_mul(device, dtype)``: the drafting layer's Triton
  kernels (interpreted on CPU) against their PyTorch forms, which are checked first against
  the layer path's operations they replace;
- ``check_draft_layer(device, dtype, fused)``: ``DraftLayer.forward`` (with its Triton kernels
  or their PyTorch forms) against the model's own
  layer-by-layer MTP forward (``forward_mtp_fused``) on random weights and a paged cache with
  committed entries: the hidden states and every cache entry written.

Each returns ``(relative max error, tolerance)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from tests.engine.kernels.fused_cases import kernel_tolerance


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def check_draft_rope(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """``draft_rope_and_store`` against ``draft_rope_and_store_torch``, which is checked first
    against the layer path's pieces on normalised inputs (float32, on CPU): the input norm's
    scale reaching ``k_rope`` only, the query norm's reaching both query parts. Cache slots the
    kernel must not touch hold garbage and are compared too."""
    from engine.kernels.draft_layer_kernels import draft_rope_and_store
    from engine.model.config import ModelConfig
    from engine.model.draft_layer import draft_rope_and_store_torch
    from engine.model.rope import RotaryEmbedding

    heads, R, P, lora, H, n = 3, 40, 16, 24, 56, 6
    cfg = ModelConfig.from_hf_dict({"model_type": "deepseek_v3", "hidden_size": H, "num_attention_heads": heads,
                                    "qk_nope_head_dim": 8, "qk_rope_head_dim": P, "kv_lora_rank": R,
                                    "v_head_dim": 8, "vocab_size": 16, "num_hidden_layers": 1,
                                    "intermediate_size": 32, "rope_interleave": True})  # fmt: skip
    rope = RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(21)
    x, a = torch.randn(n, H, generator=gen) * 3, torch.randn(n, lora + R + P, generator=gen)
    qp = torch.randn(n, heads, R + P, generator=gen)
    kv_w = torch.rand(R, generator=gen) + 0.5
    positions = torch.randint(0, 500, (n,), generator=gen)
    slots = torch.randperm(32, generator=gen)[:n]
    cache = torch.full((4, 8, R + P), 77.0)
    # The reference against the layer path's own operations (what the folded weights stand for).
    ref_cache = cache.clone()
    q_lat, q_rope = draft_rope_and_store_torch(qp, a, x, 1e-6, 1e-6, kv_w, 1e-6, rope, positions, ref_cache, slots)
    s_x = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    s_q = torch.rsqrt(a[:, :lora].pow(2).mean(-1, keepdim=True) + 1e-6)[:, :, None]
    cos, sin = rope.cos_sin(positions, torch.float32)
    c = a[:, lora : lora + R]
    entry = torch.cat([kv_w * F.rms_norm(c, (R,), eps=1e-6), rope.rotate(a[:, lora + R :] * s_x, cos, sin)], -1)
    want_cache = cache.clone()
    want_cache.view(-1, R + P)[slots] = entry
    err = max(_rel(q_lat, qp[..., :R] * s_q), _rel(q_rope, rope.rotate(qp[..., R:] * s_q, cos[:, None], sin[:, None])),
              _rel(ref_cache, want_cache))  # fmt: skip
    on = {"device": device, "dtype": dtype}
    dev_cache = cache.to(**on)  # type: ignore[arg-type]
    rope = rope.to(device)
    args = (qp.to(**on), a.to(**on), x.to(**on), 1e-6, 1e-6, kv_w.to(**on), 1e-6)  # type: ignore[arg-type]
    want_cache = dev_cache.clone()
    want = draft_rope_and_store_torch(*args, rope, positions.to(device), want_cache, slots.to(device))
    got = draft_rope_and_store(*args, positions.to(device), rope.inv_freq, rope.attention_factor, rope.interleave,
                               dev_cache, slots.to(device))  # fmt: skip
    err = max(err, _rel(got[0], want[0]), _rel(got[1], want[1]), _rel(dev_cache, want_cache))
    return err, kernel_tolerance(dtype)


def check_scaled_silu_mul(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """``scaled_silu_mul`` against its PyTorch form, itself against the norm then the SwiGLU."""
    from engine.kernels.draft_layer_kernels import scaled_silu_mul
    from engine.model.draft_layer import scaled_silu_mul_torch

    gen = torch.Generator().manual_seed(22)
    x, w = torch.randn(5, 48, generator=gen) * 2, torch.randn(2 * 72, 48, generator=gen) / 7
    gate_up = x @ w.t()  # [5, 144] the raw GEMM
    gate, up = (F.rms_norm(x, (48,), eps=1e-6) @ w.t()).chunk(2, -1)
    err = _rel(scaled_silu_mul_torch(gate_up, x, 1e-6), F.silu(gate) * up)
    on = {"device": device, "dtype": dtype}
    g, xs = gate_up.to(**on), x.to(**on)  # type: ignore[arg-type]
    return max(err, _rel(scaled_silu_mul(g, xs, 1e-6), scaled_silu_mul_torch(g, xs, 1e-6))), kernel_tolerance(dtype)


def draft_model(device: str, dtype: torch.dtype) -> torch.nn.Module:
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

    model = draft_model(device, dtype)
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
        fresh = dataclasses.replace(batch, memo={})  # a batch's memo serves one forward
        got = DraftLayer(layer).forward(x.clone(), model.rope, fresh, cache[layer_index], fused=fused)
    err = max(_rel(got, want), _rel(cache, want_cache))
    return err, 1e-4 if dtype == torch.float32 else 4e-2


def check_engine_with_drafting_layer(device: str) -> tuple[float, float]:
    """The demo model in float32, greedy, tree speculation through the graphed step with the
    drafting layer (its Triton kernels on a GPU) against autoregressive decoding over batches
    of 3 and 1. Returns (1.0, 0.0) when a token differs, (2.0, 0.0) when the drafting layer did
    not serve the MTP forwards, (3.0, 0.0) when it accepted under 90% of the layer path's
    tokens (its drafts are the same function up to rounding), else (0.0, 0.0).

    The drafting layer's forwards are counted from the engines' construction on: on a GPU the
    graphed steps run them when they are captured, at construction, and replay them after
    (counted only from the first step, they were never seen on the H200, session 42)."""
    from pathlib import Path
    from unittest import mock

    from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from engine.model.draft_layer import DraftLayer
    from train.heldout import heldout_prompts

    folder = str(Path(__file__).resolve().parents[3] / "models" / "demo")
    tree = SpecConfig(method="tree", min_path_prob=0.0)
    served: list[int] = []  # ids of the DraftLayers that ran a forward
    forward = DraftLayer.forward

    def counted(self: DraftLayer, *args: Any, **kwargs: Any) -> Any:
        served.append(id(self))
        return forward(self, *args, **kwargs)

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    accepted = {"layer": 0, "drafting": 0}
    with mock.patch.object(DraftLayer, "forward", counted):
        engines = {name: LLMEngine.from_pretrained(folder, device=device, spec=spec, engine_config=EngineConfig(
            cuda_graphs=True, max_batch_size=4, drafting_layer=drafting)) for name, spec, drafting in (
            ("ar", SpecConfig(method="none"), None), ("layer", tree, False), ("drafting", tree, True))}  # fmt: skip
        runner = engines["drafting"].graphed_tree
        if runner is None or not runner.draft_layers:
            return 2.0, 0.0
        prompts = heldout_prompts(folder, engines["ar"].tokenizer, 4, 32)  # type: ignore[arg-type]
        for batch in (prompts[:3], prompts[3:]):
            want = [o.token_ids for o in engines["ar"].generate(batch, greedy)]
            for name in accepted:
                outs = engines[name].generate(batch, greedy)
                if [o.token_ids for o in outs] != want:
                    return 1.0, 0.0
                accepted[name] += sum(o.stats.num_accepted_tokens for o in outs)
    if not {id(layer) for layer in runner.draft_layers.values()} & set(served):
        return 2.0, 0.0
    return (3.0 if accepted["drafting"] < 0.9 * accepted["layer"] else 0.0), 0.0
