"""An MTP module's decoder layer for drafting: absorbed and folded weights, deferred norms.

Each drafting depth of the graphed tree step runs a full decoder layer over a few rows per
sequence. On an H200 its kernels are latency-bound: a GEMM of 8 rows takes ~3.5 us in cuBLAS
whatever its width, and each small kernel between GEMMs ~1.5 us plus the gap between
launches. This forward computes the function of ``DeepseekV3ForCausalLM.forward_mtp_fused``
(from the module's fused input, after ``eh_proj``) in 11 kernels where the layer path takes
15 (``scripts/draft_layer_bench.py`` times both):

- every RMSNorm's weight is folded into the matrix after it (``fold_norm``) and its row scale
  ``rsqrt(mean(x^2) + eps)`` deferred to a kernel that reads the row anyway: the input norm
  and the query LoRA's norm to ``draft_rope_and_store`` (which also rotates, normalises and
  stores the latent entry), the post-attention norm to ``scaled_silu_mul``; the norms
  inside the MLA (of ``a_q`` and ``c_kv``) make the first row scale reach only ``k_rope``;
- ``q_b_proj`` has W_UK absorbed (``absorbed_query_weight``): queries come out in latent
  space, without the layer path's copy of ``q_nope`` and its product with W_UK;
- the residual adds are GEMM epilogues (``addmm_``, cuBLAS's beta = 1).

(Triton GEMMs with the norms and SwiGLU inside were tried first, session 36: at 8 rows they
took 5-7 us against cuBLAS's 3.5, so the layer was no faster; the GEMMs stay cuBLAS's.)

Its rounding differs from the layer path (float32 inside the kernels, the folded weights
rounded once), so drafts may differ in the last bits: a draft decides only what is proposed,
verification decides what is emitted, so outputs are unchanged (tested). Dense MLP modules
with a query LoRA and no biases (the DeepSeek-V3 layout); others keep the layer path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.attention import write_kv
from engine.kernels import triton_available, use_fused_kernels
from engine.model.attention_batch import AttentionBatch
from engine.model.decoder_layer import MTPLayer
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.layers import SwiGLUMLP
from engine.model.mla import MultiHeadLatentAttention
from engine.model.rope import RotaryEmbedding

# Forwards of up to this many rows take the drafting layer; larger ones keep the layer path
# (on the H200 the drafting layer was faster at 8-520 rows, 40 against 46 us at 8; session 36).
MAX_ROWS = 512


def fold_norm(weight: Tensor, norm_weight: Tensor) -> Tensor:
    """``weight`` [N, K] with an RMSNorm's weight [K] folded into its columns (float32 product,
    rounded once): ``(rms_norm(x) * norm_weight) @ weight.T == rms_norm(x) @ fold_norm(..).T``."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype).contiguous()


def _row_scale(x: Tensor, eps: float) -> Tensor:  # [N, D] -> [N, 1] float32
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def absorbed_query_weight(attn: MultiHeadLatentAttention) -> Tensor:
    """``q_b_proj`` with W_UK absorbed: [heads * (kv_rank + rope), q_lora] in float32; head h's
    rows map the normalised ``q_a`` to ``[q_nope[h] @ W_UK[h] | q_rope[h]]``."""
    heads, nope, rank = attn.num_heads, attn.nope_dim, attn.kv_rank
    w_qb = attn.q_b_proj.weight.float().view(heads, nope + attn.rope_dim, -1)  # [heads, nope+rope, q_lora]
    w_uk = attn.kv_b_proj.weight.float().view(heads, nope + attn.v_dim, rank)[:, :nope]  # [heads, nope, rank]
    latent = torch.einsum("hdr,hdq->hrq", w_uk, w_qb[:, :nope])  # [heads, rank, q_lora]
    return torch.cat([latent, w_qb[:, nope:]], 1).reshape(heads * (rank + attn.rope_dim), -1)


def draft_rope_and_store_torch(
    qp: Tensor, a: Tensor, x: Tensor, eps_x: float, eps_q: float, kv_norm_weight: Tensor, eps_kv: float,
    rope: RotaryEmbedding, positions: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
) -> tuple[Tensor, Tensor]:  # q_latent [N, heads, R], q_rope [N, heads, rope]
    """``engine.kernels.draft_layer_kernels.draft_rope_and_store`` in PyTorch (float32)."""
    R = kv_norm_weight.shape[0]
    lora = a.shape[1] - R - (qp.shape[-1] - R)
    s_q = _row_scale(a[:, :lora], eps_q)[:, :, None]  # [N, 1, 1]
    cos, sin = rope.cos_sin(positions, torch.float32)
    q_latent = qp[..., :R].float() * s_q
    q_rope = rope.rotate(qp[..., R:].float() * s_q, cos[:, None, :], sin[:, None, :])
    c = a[:, lora : lora + R].float()
    c = kv_norm_weight.float() * c * _row_scale(c, eps_kv)
    k = rope.rotate(a[:, lora + R :].float() * _row_scale(x, eps_x), cos, sin)
    write_kv(kv_cache, slot_mapping, torch.cat([c, k], -1))
    return q_latent.to(qp.dtype), q_rope.to(qp.dtype)


def scaled_silu_mul_torch(gate_up: Tensor, x: Tensor, eps: float) -> Tensor:
    """``engine.kernels.draft_layer_kernels.scaled_silu_mul`` in PyTorch (float32)."""
    gate, up = (gate_up.float() * _row_scale(x, eps)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


class DraftLayer:
    """Module ``layer``'s drafting forward (module docstring); weights derived once, at build."""

    def __init__(self, layer: MTPLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        assert self.supports(layer) and isinstance(mlp, SwiGLUMLP)
        self.layer, self.mlp = layer, mlp
        dtype = attn.q_b_proj.weight.dtype
        with torch.no_grad():
            qkv_a = torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight])
            self.qkv_a = fold_norm(qkv_a, layer.input_layernorm.weight)  # [lora + rank + rope, H]
            self.q = fold_norm(absorbed_query_weight(attn), attn.q_a_layernorm.weight).to(dtype)
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self.gate_up = fold_norm(gate_up, layer.post_attention_layernorm.weight)  # [2I, H]

    @staticmethod
    def supports(layer: MTPLayer) -> bool:
        attn = layer.self_attn
        if not attn.q_lora_rank or not isinstance(layer.mlp, SwiGLUMLP):
            return False
        return all(lin.bias is None for lin in (attn.q_a_proj, attn.kv_a_proj_with_mqa, attn.o_proj))

    def forward(
        self,
        x: Tensor,  # [M, H] the module's fused input (``MTPLayer.fuse_input_parts``); updated in place
        rope: RotaryEmbedding,
        batch: AttentionBatch,
        kv_cache: Tensor,  # [num_blocks, block_size, kv_rank + rope] the module's cache
        fused: bool | None = None,  # the Triton kernels (None: in inference on a GPU)
    ) -> Tensor:  # [M, H] the module's normalised hidden
        layer = self.layer
        attn = layer.self_attn
        fused = use_fused_kernels(x) if fused is None else fused
        M, lora, rank = x.shape[0], attn.q_lora_rank, attn.kv_rank
        a = F.linear(x, self.qkv_a)  # [M, lora + rank + rope], before the input norm's row scale
        qp = F.linear(a[:, :lora], self.q).view(M, attn.num_heads, rank + attn.rope_dim)  # [M, heads, rank + rope]
        eps = (layer.input_layernorm.eps, attn.q_a_layernorm.eps)
        kv_norm = attn.kv_a_layernorm
        if fused:
            from engine.kernels.draft_layer_kernels import draft_rope_and_store

            q_latent, q_rope = draft_rope_and_store(
                qp, a, x, *eps, kv_norm.weight, kv_norm.eps, batch.positions, rope.inv_freq,
                rope.attention_factor, rope.interleave, kv_cache, batch.slot_mapping,
            )  # fmt: skip
        else:
            q_latent, q_rope = draft_rope_and_store_torch(
                qp, a, x, *eps, kv_norm.weight, kv_norm.eps, rope, batch.positions, kv_cache, batch.slot_mapping,
            )  # fmt: skip
        out_latent = attn.attend(q_latent, q_rope, batch, kv_cache)  # [M, heads, rank]
        x.addmm_(attn.values(out_latent), attn.o_proj.weight.t())  # x += o_proj(values)
        gate_up = F.linear(x, self.gate_up)  # [M, 2I] before the post-attention norm's row scale
        eps_post = layer.post_attention_layernorm.eps
        if fused:
            from engine.kernels.draft_layer_kernels import scaled_silu_mul

            act = scaled_silu_mul(gate_up, x, eps_post)
        else:
            act = scaled_silu_mul_torch(gate_up, x, eps_post)  # [M, I]
        x.addmm_(act, self.mlp.down_proj.weight.t())  # x += down(act)
        return layer.shared_head.norm(x)


def draft_layers(model: DeepseekV3ForCausalLM, on: bool | None) -> dict[int, DraftLayer]:
    """module -> its drafting forward, for every MTP module it supports (``EngineConfig.
    drafting_layer``; ``on`` None: on CUDA with Triton in a 16-bit dtype). Built once per
    engine and shared by its graphed tree steps and its catch-up."""
    param = next(model.parameters())
    if on is None:
        on = param.is_cuda and triton_available() and param.dtype in (torch.bfloat16, torch.float16)
    if not on:
        return {}
    layers = {m: model.mtp_layer(m) for m in range(1, model.config.num_mtp_modules + 1)}
    return {m: DraftLayer(layer) for m, layer in layers.items() if DraftLayer.supports(layer)}


def forward_mtp_fused(
    model: DeepseekV3ForCausalLM,
    drafts: dict[int, DraftLayer],  # ``draft_layers``
    depth: int,  # 1-based module
    fused: Tensor,  # [N, H] the module's fused input (``MTPLayer.fuse_input_ids`` / ``_parts``)
    batch: AttentionBatch,
    kv_cache: Tensor,  # [layers_total, num_blocks, block_size, latent]
) -> Tensor:  # [N, H] the module's normalised hidden
    """``model.forward_mtp_fused`` through the drafting layer where it serves (its module, at
    most ``MAX_ROWS`` rows)."""
    draft = drafts.get(depth) if fused.shape[0] <= MAX_ROWS else None
    if draft is None:
        return model.forward_mtp_fused(depth, fused, batch, kv_cache)
    return draft.forward(fused, model.rope, batch, kv_cache[model.mtp_cache_layer(depth)])


def forward_mtp(
    model: DeepseekV3ForCausalLM,
    drafts: dict[int, DraftLayer],
    depth: int,
    prev_hidden: Tensor,  # [N, H]
    input_ids: Tensor,  # [N]
    batch: AttentionBatch,
    kv_cache: Tensor,
) -> Tensor:  # [N, H]
    """``model.forward_mtp`` likewise."""
    fused = model.mtp_layer(depth).fuse_input_ids(model.model.embed_tokens, input_ids, prev_hidden)  # [N, H]
    return forward_mtp_fused(model, drafts, depth, fused, batch, kv_cache)
