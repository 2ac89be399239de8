"""DeepSeek-V3 mixture of experts: sigmoid router with bias-corrected, group-limited top-k.

Routing (DeepSeek-V3 paper, §2.1.2): scores = sigmoid(x W_g); experts are chosen on
``scores + e_score_correction_bias`` restricted to the ``topk_group`` best groups (a group's score
is the sum of its two best experts); the chosen experts are weighted by their *uncorrected*
scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``. Shared experts
always run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.layers import SwiGLUMLP


class TopkRouter(nn.Module):
    """Checkpoint names: ``mlp.gate.weight`` [E, H] and ``mlp.gate.e_score_correction_bias`` [E]."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        topk_idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, topk_idx


class MoE(nn.Module):
    """Routed experts (stored one module per expert, as in the HF checkpoint) + shared experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = nn.ModuleList(
            SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        weights, expert_ids = self.gate(flat)  # [T, k], [T, k]
        out = torch.zeros_like(flat)
        # Loop only over experts that received tokens; each runs one batched matmul.
        for expert_id in expert_ids.unique().tolist():
            token_idx, slot = torch.where(expert_ids == expert_id)
            expert_out = self.experts[expert_id](flat[token_idx])
            out.index_add_(0, token_idx, (expert_out * weights[token_idx, slot, None]).to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
