"""An MTP module's decoder layer for drafting: absorbed weights and fused GEMMs, 8 launches.

Each drafting depth of the graphed tree step runs a full decoder layer over a few rows per
sequence; on an H200 a depth of the ``gpu`` preset took ~78 us in ~20 kernels, most of them
latency-bound (session 35). This forward computes the same function as
``DeepseekV3ForCausalLM.forward_mtp_fused`` from the module's fused input (after ``eh_proj``):

1. ``qkv_a = rms_norm(x) @ [W_qa; W_kva]^T``: the input norm inside the GEMM (``fused_linear``;
   every norm's weight is folded into the matrix after it);
2. ``q = rms_norm(q_a) @ W_q^T`` with ``W_q`` the query projection with W_UK absorbed: its
   no-rope part of each head is already in latent space (``W_UK[h]^T @ W_qb_nope[h]``), so no
   ``q_nope @ W_UK`` afterwards;
3. the rope rotation and the latent cache write (``rope_and_store_latent``, as the target's);
4. the absorbed attention over the paged latent cache (as the target's);
5. ``x + out_latent @ W_o^T`` with ``W_o = o_proj @ W_UV`` (per head), the residual added in
   the GEMM: no per-head ``W_UV`` product and no add;
6. ``silu(g) * u`` of ``rms_norm(x) @ [W_gate; W_up]^T``: norm, GEMM and SwiGLU in one launch;
7. ``x + act @ W_down^T``;
8. ``shared_head.norm``.

Its rounding differs from the layer-by-layer path (``fused_linear``'s docstring), and the
absorbed products are rounded to the model's dtype once, so drafts may differ in the last
bits: a draft decides only what is proposed, and verification decides what is emitted, so the
output is unchanged (tested: greedy decoding equals autoregressive decoding with it on). Dense
MLP modules with a query LoRA only (the DeepSeek-V3 layout; MoE modules keep the layer path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import use_fused_kernels
from engine.model.attention_batch import AttentionBatch
from engine.model.decoder_layer import MTPLayer
from engine.model.layers import SwiGLUMLP
from engine.model.mla import MultiHeadLatentAttention
from engine.model.rope import RotaryEmbedding


def _linear(x: torch.Tensor, weight: torch.Tensor, fused: bool, **kwargs: object) -> torch.Tensor:
    if fused:
        from engine.kernels.fused_linear import fused_linear

        return fused_linear(x, weight, **kwargs)  # type: ignore[arg-type]
    return fused_linear_torch(x, weight, **kwargs)  # type: ignore[arg-type]


def fold_norm(weight: Tensor, norm_weight: Tensor) -> Tensor:
    """``weight`` [N, K] with an RMSNorm's weight [K] folded into its columns (float32 product,
    rounded once): ``rms_norm(x) * norm_weight @ weight.T == rms_norm(x) @ fold_norm(...).T``."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype).contiguous()


def interleave_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """[I, K] x2 -> [2I, K] rows gate 0, up 0, gate 1, up 1, ... (the gated layout)."""
    return torch.stack([gate, up], 1).reshape(-1, gate.shape[1]).contiguous()


def fused_linear_torch(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K] or [2N, K] gate/up rows interleaved when gated
    rms_eps: float | None = None,
    residual: Tensor | None = None,  # [M, N]
    gated: bool = False,
) -> Tensor:  # [M, N] in x's dtype
    """``fused_linear``'s computation in float32 PyTorch, rounded once at the end."""
    h = x.float()
    if rms_eps is not None:
        h = F.rms_norm(h, (h.shape[-1],), eps=rms_eps)
    y = h @ weight.float().t()  # [M, N or 2N]
    if gated:
        y = F.silu(y[:, 0::2]) * y[:, 1::2]
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def absorbed_query_weight(attn: MultiHeadLatentAttention) -> torch.Tensor:
    """``q_b_proj`` with W_UK absorbed: [heads * (kv_rank + rope), q_lora]; head h's rows map
    the normalised ``q_a`` to ``[q_nope[h] @ W_UK[h] | q_rope[h]]``."""
    heads, nope, rank = attn.num_heads, attn.nope_dim, attn.kv_rank
    w_qb = attn.q_b_proj.weight.float().view(heads, nope + attn.rope_dim, -1)  # [heads, nope+rope, q_lora]
    w_uk = attn.kv_b_proj.weight.float().view(heads, nope + attn.v_dim, rank)[:, :nope]  # [heads, nope, rank]
    latent = torch.einsum("hdr,hdq->hrq", w_uk, w_qb[:, :nope])  # [heads, rank, q_lora]
    return torch.cat([latent, w_qb[:, nope:]], 1).reshape(heads * (rank + attn.rope_dim), -1)


def absorbed_output_weight(attn: MultiHeadLatentAttention) -> torch.Tensor:
    """``o_proj`` with W_UV absorbed: [H, heads * kv_rank] from the attention's latent output."""
    heads, nope, rank, v = attn.num_heads, attn.nope_dim, attn.kv_rank, attn.v_dim
    w_uv = attn.kv_b_proj.weight.float().view(heads, nope + v, rank)[:, nope:]  # [heads, v, rank]
    w_o = attn.o_proj.weight.float().view(-1, heads, v)  # [H, heads, v]
    return torch.einsum("chv,hvr->chr", w_o, w_uv).reshape(w_o.shape[0], heads * rank)


class DraftLayer:
    """Module ``layer``'s drafting forward (module docstring); weights derived once, at build."""

    def __init__(self, layer: MTPLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, SwiGLUMLP) and attn.q_lora_rank
        self.layer = layer
        dtype = attn.q_b_proj.weight.dtype
        with torch.no_grad():
            qkv_a = torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight])
            self.qkv_a = fold_norm(qkv_a, layer.input_layernorm.weight)
            self.q = fold_norm(absorbed_query_weight(attn), attn.q_a_layernorm.weight).to(dtype)
            self.o = absorbed_output_weight(attn).to(dtype)
            gate_up = interleave_gate_up(mlp.gate_proj.weight, mlp.up_proj.weight)
            self.gate_up = fold_norm(gate_up, layer.post_attention_layernorm.weight)
            self.down = mlp.down_proj.weight.detach().contiguous()

    @staticmethod
    def supports(layer: MTPLayer) -> bool:
        attn = layer.self_attn
        plain = all(lin.bias is None for lin in (attn.q_a_proj, attn.kv_a_proj_with_mqa, attn.o_proj)) \
            if attn.q_lora_rank else False  # fmt: skip
        return plain and isinstance(layer.mlp, SwiGLUMLP)

    def forward(
        self,
        x: torch.Tensor,  # [M, H] the module's fused input (``MTPLayer.fuse_input_parts``)
        rope: RotaryEmbedding,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_rank + rope] the module's cache
        fused: bool | None = None,  # the GEMMs as Triton kernels (None: in inference on a GPU)
    ) -> torch.Tensor:  # [M, H] the module's normalised hidden
        layer = self.layer
        attn = layer.self_attn
        fused = use_fused_kernels(x) if fused is None else fused
        M, lora, rank = x.shape[0], attn.q_lora_rank, attn.kv_rank
        qkv_a = _linear(x, self.qkv_a, fused, rms_eps=layer.input_layernorm.eps)  # [M, lora + rank + rope]
        q = _linear(qkv_a[:, :lora], self.q, fused, rms_eps=attn.q_a_layernorm.eps)
        q = q.view(M, attn.num_heads, rank + attn.rope_dim)  # [M, heads, rank + rope]
        q_latent, q_rope = attn.rope_and_store(q, qkv_a[:, lora:], rank, rope, None, batch, kv_cache)
        out_latent = attn.attend(q_latent, q_rope, batch, kv_cache)  # [M, heads, rank]
        x = _linear(out_latent.reshape(M, -1), self.o, fused, residual=x)  # [M, H]
        eps = layer.post_attention_layernorm.eps
        act = _linear(x, self.gate_up, fused, rms_eps=eps, gated=True)  # [M, I]
        x = _linear(act, self.down, fused, residual=x)  # [M, H]
        return layer.shared_head.norm(x)
