"""One DeepSeek-V3 block: pre-norm MLA + pre-norm MLP (dense or MoE), both residual."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import use_fused_kernels
from engine.model.attention_batch import AttentionBatch
from engine.model.config import ModelConfig
from engine.model.layers import Linear, RMSNorm, SwiGLUMLP, add_rms_norm
from engine.model.mla import MultiHeadLatentAttention
from engine.model.moe import MoE
from engine.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(layer_idx) else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward_paged(
        self,
        x: torch.Tensor,  # [N, H] residual stream
        rope: RotaryEmbedding,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin [N, rope/2]; None: fused
        batch: AttentionBatch,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, latent]
        pending: torch.Tensor | None = None,  # [N, H] the previous layer's MLP output, not yet added
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, this layer's MLP output, not yet added). Each residual add is
        done with the norm that follows it (``add_rms_norm``: one launch on a GPU); the caller
        adds the last one with its final norm."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = add_rms_norm(self.input_layernorm, x, pending)
        attn = self.self_attn.forward_paged(h, rope, rope_tables, batch, kv_cache)
        x, h = add_rms_norm(self.post_attention_layernorm, x, attn)
        return x, self.mlp(h)

    def forward_dense(
        self,
        x: torch.Tensor,  # [B, T, H]
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,  # [T, T] bool
    ) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), rope, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """Holds only the MTP module's output norm; the head matrix is the main model's lm_head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """MTP module i, stored as decoder layer ``num_hidden_layers + i``.

    h_d = shared_head.norm(Block(eh_proj([enorm(emb(x_{t+d})); hnorm(h_{d-1})])))
    The embedding-first concatenation order and the normalised hand-over between depths follow
    the published weights as transformers' ``MtpLayer`` and vLLM's ``deepseek_mtp`` read them.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def fuse_inputs(self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] x2 -> [..., H]."""
        return self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(prev_hidden)], dim=-1))

    def fuse_input_ids(self, embed: nn.Embedding, input_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """``fuse_inputs(embed(input_ids), prev_hidden)``: input_ids [N], prev_hidden [N, H] ->
        [N, H]. In inference on a GPU the lookup, both norms and the concatenation are one
        kernel (``engine.kernels.fused_layers.mtp_input``)."""
        return self.fuse_input_parts(embed, [input_ids[None]], [prev_hidden.contiguous()[None]])

    def fuse_input_parts(
        self,
        embed: nn.Embedding,
        token_parts: list[torch.Tensor],  # [B, T_i] the rows' tokens, in parts
        prev_parts: list[torch.Tensor],  # [B, P_i, H] their previous-depth hidden, in parts
        fused: bool | None = None,  # the Triton kernel (None: in inference on a GPU)
    ) -> torch.Tensor:  # [B * R, H], rows sequence-major
        """``fuse_input_ids`` of the rows ``cat(token_parts, 1)``, ``cat(prev_parts, 1)``: the
        kernel reads each part where it lies (``engine.kernels.fused_layers.mtp_input_parts``,
        up to 2 token and 3 hidden parts, last dims contiguous); else they are concatenated."""
        dtype = prev_parts[0].dtype
        if use_fused_kernels(prev_parts[0]) if fused is None else fused:
            if embed.weight.dtype == self.enorm.weight.dtype == dtype:
                from engine.kernels.fused_layers import mtp_input_parts

                rows = mtp_input_parts(token_parts, prev_parts, embed.weight, self.enorm.weight,
                                       self.enorm.eps, self.hnorm.weight, self.hnorm.eps)  # fmt: skip
                return self.eh_proj(rows)
        tokens = torch.cat(token_parts, 1) if len(token_parts) > 1 else token_parts[0]  # [B, R]
        prev = torch.cat(prev_parts, 1) if len(prev_parts) > 1 else prev_parts[0]  # [B, R, H]
        return self.fuse_inputs(embed(tokens.reshape(-1)), prev.reshape(tokens.numel(), -1))
