"""Small building blocks: RMSNorm and the SwiGLU MLP (dense layers, shared and routed experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import use_fused_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled by a learned weight (as the DeepSeek-V3 reference)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype and use_fused_kernels(x):
            from engine.kernels.fused_layers import rms_norm

            return rms_norm(x, self.weight, self.eps)  # the same computation in one launch
        # x * rsqrt(mean(x^2) + eps) in float32 (one fused kernel where PyTorch has it), then
        # the weight in the input dtype, in the reference's order.
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
