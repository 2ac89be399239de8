"""Multi-head Latent Attention (DeepSeek-V2/V3) in two forms.

* ``forward_paged`` — inference, *absorbed* form: the cache holds only the normalised latent
  ``c_kv`` [kv_lora_rank] and the rotated rope key [qk_rope_head_dim] per token and layer.
  Queries are mapped into latent space with W_UK (``q_latent = q_nope @ W_UK``), attention runs
  against the latents, and W_UV maps the result back per head. Nothing is decompressed into the
  cache.
* ``forward_dense`` — training and reference, *expanded* form over a full sequence with an
  explicit boolean mask (standard causal, or the band mask of deeper MTP modules).
Both compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import paged_mla_attention, write_kv
from engine.kernels import use_fused_kernels
from engine.model.attention_batch import AttentionBatch
from engine.model.config import ModelConfig
from engine.model.layers import Linear, RMSNorm, fuse_rows, still_fused
from engine.model.rope import RotaryEmbedding, softmax_scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        qk_dim = cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk_dim, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = softmax_scale(cfg)
        self._qkv_a: torch.Tensor | None = None  # [q_lora + kv_rank + rope, H] after fuse_projections

    def fuse_projections(self) -> None:
        """Inference: ``q_a_proj`` and ``kv_a_proj_with_mqa`` (both read the layer input) as one
        GEMM (``fuse_rows``); without a q LoRA there is nothing to fuse."""
        if self.q_lora_rank and not still_fused(self._qkv_a, self.q_a_proj, self.kv_a_proj_with_mqa):
            self._qkv_a = fuse_rows(self.q_a_proj, self.kv_a_proj_with_mqa)

    # ---- shared pieces ----
    def _project_queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> q [..., heads, nope + rope] (rope part not rotated)."""
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.view(*x.shape[:-1], self.num_heads, self.nope_dim + self.rope_dim)

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> q_nope [..., heads, nope], q_rope [..., heads, rope] (not rotated)."""
        q = self._project_queries(x)
        return q[..., : self.nope_dim], q[..., self.nope_dim :]

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> c_kv [..., kv_rank] (normalised), k_rope [..., rope] (not rotated)."""
        kv = self.kv_a_proj_with_mqa(x)
        return self.kv_a_layernorm(kv[..., : self.kv_rank]), kv[..., self.kv_rank :]

    def _project_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> q [N, heads, nope + rope] (rope part not rotated), kv [N, kv_rank + rope]
        (``kv_a_proj_with_mqa``'s output); both first projections in one GEMM once fused."""
        if self.q_lora_rank and still_fused(self._qkv_a, self.q_a_proj, self.kv_a_proj_with_mqa):
            assert self._qkv_a is not None
            a = F.linear(x, self._qkv_a)  # [N, q_lora + kv_rank + rope]
            q = self.q_b_proj(self.q_a_layernorm(a[..., : self.q_lora_rank]))
            q = q.view(*x.shape[:-1], self.num_heads, self.nope_dim + self.rope_dim)
            return q, a[..., self.q_lora_rank :]
        return self._project_queries(x), self.kv_a_proj_with_mqa(x)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, kv_rank], W_UV [heads, v, kv_rank] from kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    # ---- inference: absorbed MLA over the paged latent cache ----
    def forward_paged(
        self,
        x: torch.Tensor,  # [N, H]
        rope: RotaryEmbedding,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin [N, rope/2]; None: fused
        batch: AttentionBatch,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_rank + rope] this layer's cache
    ) -> torch.Tensor:
        q_nope, q_rope = self._rope_and_store_latent(x, rope, rope_tables, batch, kv_cache)
        w_uk, _ = self._absorb_weights()
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # [N, heads, kv_rank]
        out_latent = self.attend(q_latent, q_rope, batch, kv_cache)  # [N, heads, kv_rank]
        return self.o_proj(self.values(out_latent))

    def values(self, out_latent: torch.Tensor) -> torch.Tensor:  # [N, heads, kv_rank] -> [N, heads * v]
        """The attention's latent output mapped back per head by W_UV (``o_proj``'s input)."""
        _, w_uv = self._absorb_weights()
        # einsum("nhr,hvr->nhv") is a batched GEMM over heads whose [heads, N, v] result is
        # copied into [N, heads, v] for o_proj whenever N > 1 (a kernel per layer, 18 of a batch-1
        # tree step's ~345 on the H200); written through a transposed view, the GEMM stores it
        # there itself (cuBLAS takes the row stride heads * v).
        # (Under autograd, where out= is not allowed, the einsum stays.)
        n = out_latent.shape[0]
        if torch.is_grad_enabled() and (out_latent.requires_grad or w_uv.requires_grad):
            out = torch.einsum("nhr,hvr->nhv", out_latent, w_uv)  # [N, heads, v]
        else:
            out = out_latent.new_empty(n, self.num_heads, self.v_dim)  # [N, heads, v]
            torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out.reshape(n, self.num_heads * self.v_dim)

    def attend(
        self,
        q_latent: torch.Tensor,  # [N, heads, kv_rank] (last dim contiguous)
        q_rope: torch.Tensor,  # [N, heads, rope] rotated
        batch: AttentionBatch,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_rank + rope] this layer's cache
    ) -> torch.Tensor:  # [N, heads, kv_rank]
        """Absorbed attention of the batch's queries over the paged latent cache."""
        return paged_mla_attention(
            q_latent, q_rope, kv_cache, batch.block_tables, batch.ctx_lens, batch.query_start,
            batch.new_mask, self.scale, query_ctx_lens=batch.query_ctx_lens, memo=batch.memo,
        )  # fmt: skip

    def write_latent(
        self,
        x: torch.Tensor,  # [N, H] normed layer input
        rope: RotaryEmbedding,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> None:
        """Only the tokens' latent entries written to the cache (no attention): what rows whose
        outputs nobody reads still owe the rows after them."""
        self._rope_and_store_latent(x, rope, rope_tables, batch, kv_cache)

    def fused_kernels_apply(self, x: torch.Tensor) -> bool:
        """The fused RoPE + latent-store kernel serves this layer's inference on ``x``."""
        half = self.rope_dim // 2
        return use_fused_kernels(x) and self.kv_a_layernorm.weight.dtype == x.dtype and half & (half - 1) == 0

    def _rope_and_store_latent(
        self,
        x: torch.Tensor,  # [N, H]
        rope: RotaryEmbedding,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin [N, rope/2]
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q_nope [N, heads, nope], rotated q_rope [N, heads, rope]
        """Queries, and the tokens' latent entries [c_kv | rotated k_rope] written to the cache.

        ``rope_tables`` None (see ``DeepseekV3ForCausalLM._rope_tables``): the fused kernel
        computes cos/sin where it applies, else they are computed here.
        """
        norm = self.kv_a_layernorm
        q, kv = self._project_inputs(x)  # [N, heads, nope + rope], [N, kv_rank + rope]
        if rope_tables is None and self.fused_kernels_apply(x):
            from engine.kernels.fused_layers import rope_and_store_latent

            q_rope = rope_and_store_latent(
                q, kv, norm.weight, norm.eps, batch.positions, rope.inv_freq, rope.attention_factor,
                kv_cache, batch.slot_mapping, self.nope_dim, rope.interleave,
            )  # one launch for cos/sin, the rotations, the norm and the cache write
            return q[..., : self.nope_dim], q_rope
        cos, sin = rope_tables if rope_tables is not None else rope.cos_sin(batch.positions, x.dtype)
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim :]
        c_kv, k_rope = norm(kv[..., : self.kv_rank]), kv[..., self.kv_rank :]
        q_rope = rope.rotate(q_rope, cos[:, None, :], sin[:, None, :])
        k_rope = rope.rotate(k_rope, cos, sin)
        write_kv(kv_cache, batch.slot_mapping, torch.cat([c_kv, k_rope], dim=-1))
        return q_nope, q_rope

    # ---- training / reference: expanded MLA over whole sequences ----
    def forward_dense(
        self,
        x: torch.Tensor,  # [B, T, H]
        rope: RotaryEmbedding,
        cos: torch.Tensor,  # [T, rope/2]
        sin: torch.Tensor,  # [T, rope/2]
        mask: torch.Tensor,  # [T, T] bool, True = may attend
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q_nope, q_rope = self._queries(x)  # [B, T, heads, nope/rope]
        c_kv, k_rope = self._latents(x)  # [B, T, kv_rank], [B, T, rope]
        q_rope = rope.rotate(q_rope, cos[None, :, None, :], sin[None, :, None, :])
        k_rope = rope.rotate(k_rope, cos[None], sin[None])
        kv = self.kv_b_proj(c_kv).view(bsz, seq, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # [B, heads, T, qk]
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(-1, -1, self.num_heads, -1)], dim=-1)
        k = k.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask, scale=self.scale
        )  # [B, heads, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.v_dim))
