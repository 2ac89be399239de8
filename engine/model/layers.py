"""Small building blocks: Linear, RMSNorm and the SwiGLU MLP (dense layers, shared and routed
experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import use_fused_kernels


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU inference over several float32 rows runs as ``W @ x.T``.

    This machine's BLAS (MKL on an AMD EPYC, weights cold in cache) multiplies a few rows
    slowly in ``x @ W.T`` form: for the demo model's 384 -> 896 projection, 2 / 8 / 64 rows take
    0.19 / 0.23 / 0.62 ms against 0.08 / 0.20 / 0.39 ms as ``W @ x.T``; one row is as fast
    either way. A tree verify (8 rows) and the MTP drafting rows are such shapes; one
    autoregressive row is not. Training, GPUs and other dtypes take ``F.linear`` unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() == 2
            and x.shape[0] > 1
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            out = (self.weight @ x.t()).t().contiguous()  # [N, out]
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


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
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
