"""DeepSeek-V3 causal LM with its MTP modules, owning nothing but weights.

Parameter names equal the Hugging Face checkpoint names, so loading and exporting are plain
state-dict copies. The main model's embedding and lm_head are shared by every MTP module.

Hidden-state convention (documented choice, matching transformers' MTP reading of the published
weights): the hidden state handed to MTP depth 1 is the main model's *final-normed* hidden
state, and each MTP module hands on its output *after* ``shared_head.norm`` — the same vector
its logits are computed from.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention_batch import AttentionBatch
from engine.model.config import ModelConfig
from engine.model.decoder_layer import DecoderLayer, MTPLayer
from engine.model.layers import Linear, RMSNorm, SwiGLUMLP, add_rms_norm
from engine.model.mla import MultiHeadLatentAttention
from engine.model.rope import RotaryEmbedding


def mtp_band_mask(seq_len: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, T] bool mask for MTP module ``depth`` (1-based) in training.

    Row t sees itself and rows j <= t - (depth - 1). For depths 1 and 2 this is the causal mask.
    Deeper modules cannot see their own most recent ``depth - 2`` entries at draft time (those
    entries would need tokens that are still drafts), so they are trained without them too:
    drafting then computes exactly the function that was trained.
    """
    idx = torch.arange(seq_len, device=device)
    diff = idx[:, None] - idx[None, :]
    return (diff == 0) | (diff >= max(depth - 1, 1))


class DeepseekV3Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        layers += [
            MTPLayer(cfg, cfg.num_hidden_layers + i) for i in range(cfg.num_nextn_predict_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg)

    # ---- structure ----
    @property
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.config.num_hidden_layers])  # type: ignore[arg-type]

    def mtp_layer(self, depth: int) -> MTPLayer:
        """MTP module for 1-based ``depth`` (must be <= num_nextn_predict_layers)."""
        layer = self.model.layers[self.config.num_hidden_layers + depth - 1]
        assert isinstance(layer, MTPLayer)
        return layer

    def fuse_projections(self) -> None:
        """Inference: every layer's linears that read the same input become one GEMM each (MLP
        gate and up; MLA ``q_a_proj`` and ``kv_a_proj_with_mqa``), 2 fewer launches per layer.
        Weights keep their names and values (views of the fused tensors). Idempotent."""
        for module in self.modules():
            if isinstance(module, SwiGLUMLP | MultiHeadLatentAttention):
                module.fuse_projections()

    def mtp_cache_layer(self, depth: int) -> int:
        """Index of MTP module ``depth``'s latent cache in the KV pool's layer axis."""
        return self.config.num_hidden_layers + depth - 1

    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for router bias."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, param in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
                else:
                    param.zero_()
        for buf_name, buf in self.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.zero_()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised hidden [..., H] -> logits [..., V] in float32.

        CPU inference picks the GEMM layout that this machine's BLAS (MKL on an AMD EPYC, the
        head cold in cache) runs fastest, measured on the demo model's head: several float32
        rows go through ``Linear`` (``W @ x.T``: 2 / 8 rows 0.5 / 1.4 ms, against 1.3 / 2.8 ms
        with the copy below and 3.8 / 3.2 ms as ``x @ W.T``); one row, or any rows in a 16-bit
        dtype, multiply a contiguous ``[H, V]`` copy (float32, 1 row: 0.8 ms, 1.9 ms as
        ``x @ W.T``). The copy follows the weight's version, so training never reads a stale
        one. (A bfloat16 draft head was tried on top: no faster end to end.)"""
        if hidden.is_cuda or torch.is_grad_enabled():
            return self.lm_head(hidden).float()
        flat = hidden.reshape(-1, hidden.shape[-1])  # [R, H]
        if flat.shape[0] > 1 and flat.dtype == torch.float32:
            out = self.lm_head(flat)  # [R, V]
        else:
            out = flat @ self._head_t()  # [R, V]
        return out.float().reshape(*hidden.shape[:-1], out.shape[-1])

    def _head_t(self) -> torch.Tensor:
        """A contiguous ``[H, V]`` copy of the head, cached while the weight is unchanged."""
        weight = self.lm_head.weight
        cached = self.__dict__.get("_head_t_cache")
        if cached is None or cached[0] is not weight or cached[1] != weight._version:
            cached = (weight, weight._version, weight.detach().t().contiguous())
            self.__dict__["_head_t_cache"] = cached
        return cached[2]

    # ---- inference over the paged cache ----
    def _rope_tables(self, x: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin of the batch's positions, once per forward; None where the fused kernel
        computes them itself (every layer's attention has the same shapes)."""
        attn = self.model.layers[0].self_attn
        assert isinstance(attn, MultiHeadLatentAttention)
        if attn.fused_kernels_apply(x):
            return None
        return self.rope.cos_sin(batch.positions, x.dtype)

    def forward_target(
        self,
        input_ids: torch.Tensor,  # [N]
        batch: AttentionBatch,
        kv_cache: torch.Tensor,  # [layers_total, num_blocks, block_size, latent]
    ) -> torch.Tensor:
        """Main model on the batch's new tokens -> final-normed hidden [N, H]."""
        x = self.model.embed_tokens(input_ids)
        rope_tables = self._rope_tables(x, batch)
        pending = None  # a layer's MLP output, added by the next norm (DecoderLayer.forward_paged)
        for i, layer in enumerate(self.main_layers):
            x, pending = layer.forward_paged(x, self.rope, rope_tables, batch, kv_cache[i], pending)
        return self.model.norm(x) if pending is None else add_rms_norm(self.model.norm, x, pending)[1]

    def _mtp_input(self, depth: int, prev_hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[MTPLayer, torch.Tensor]:
        """Module ``depth`` and its fused input [N, H] (token embedding and depth-1 hidden)."""
        layer = self.mtp_layer(depth)
        return layer, layer.fuse_input_ids(self.model.embed_tokens, input_ids, prev_hidden)

    def forward_mtp(
        self,
        depth: int,  # 1-based module index
        prev_hidden: torch.Tensor,  # [N, H] normalised hidden of depth-1
        input_ids: torch.Tensor,  # [N] token x_{t+depth} for each row
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """MTP module ``depth`` -> its normalised hidden [N, H] (logits via ``self.logits``)."""
        _, x = self._mtp_input(depth, prev_hidden, input_ids)
        return self.forward_mtp_fused(depth, x, batch, kv_cache)

    def forward_mtp_fused(
        self,
        depth: int,  # 1-based module index
        fused: torch.Tensor,  # [N, H] the module's fused input (``MTPLayer.fuse_input_ids``)
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``forward_mtp`` from the module's fused input rows (the graphed tree step builds them
        from the parts its rows come in: ``MTPLayer.fuse_input_parts``)."""
        layer = self.mtp_layer(depth)
        rope_tables = self._rope_tables(fused, batch)
        x, pending = layer.forward_paged(fused, self.rope, rope_tables, batch, kv_cache[self.mtp_cache_layer(depth)])
        return add_rms_norm(layer.shared_head.norm, x, pending)[1]

    def write_mtp_latents(
        self,
        depth: int,  # 1-based module index
        prev_hidden: torch.Tensor,  # [N, H] normalised hidden of depth-1
        input_ids: torch.Tensor,  # [N] token x_{t+depth} for each row
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> None:
        """Module ``depth``'s latent cache entries for the rows, nothing else: the catch-up of the
        last module, whose outputs feed no deeper module (its entries are what its later rows
        and drafts attend to). The entries equal ``forward_mtp``'s."""
        layer, x = self._mtp_input(depth, prev_hidden, input_ids)
        layer.self_attn.write_latent(
            layer.input_layernorm(x), self.rope, self._rope_tables(x, batch), batch,
            kv_cache[self.mtp_cache_layer(depth)],
        )  # fmt: skip

    # ---- training / reference over whole sequences ----
    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> final-normed hidden [B, T, H] with full causal attention (positions 0..T-1)."""
        seq = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(seq, device=input_ids.device)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        mask = mtp_band_mask(seq, 1, input_ids.device)
        for layer in self.main_layers:
            x = layer.forward_dense(x, self.rope, cos, sin, mask)
        return self.model.norm(x)

    def mtp_forward_train(
        self,
        depth: int,
        prev_hidden: torch.Tensor,  # [B, T', H] normalised hidden of depth-1 at positions t
        next_ids: torch.Tensor,  # [B, T'] tokens x_{t+depth}
        start_position: int = 0,  # position of row 0's hidden state t
    ) -> torch.Tensor:
        """MTP module ``depth`` over rows t = start..start+T'-1 -> normalised hidden [B, T', H].

        RoPE position of row t is t + depth (the position of the token it consumes), as in the
        reference MTP implementation.
        """
        seq = next_ids.shape[1]
        layer = self.mtp_layer(depth)
        x = layer.fuse_inputs(self.model.embed_tokens(next_ids), prev_hidden)
        positions = torch.arange(seq, device=next_ids.device) + start_position + depth
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        x = layer.forward_dense(x, self.rope, cos, sin, mtp_band_mask(seq, depth, next_ids.device))
        return layer.shared_head.norm(x)
