"""Small building blocks: Linear, RMSNorm, the SwiGLU MLP (dense layers, shared and routed
experts), and the fusion of linears that share their input into one GEMM (inference)."""

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


def fuse_rows(*linears: nn.Linear) -> torch.Tensor | None:
    """Inference: re-point the weights of ``linears`` (one input size, no bias) to row blocks of
    one new tensor, and return it: ``F.linear(x, fused)`` then computes all of them in one GEMM
    (on a GPU a small batch's projection is a ~4 us launch whatever its width). The parameters
    keep their names and values as views of the fused tensor, so no memory is added and a
    ``load_state_dict`` still lands in it. None (nothing changed) where a linear has a bias."""
    if any(lin.bias is not None for lin in linears):
        return None
    fused = torch.cat([lin.weight.detach() for lin in linears])  # [sum of out, in]
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    return fused


def still_fused(fused: torch.Tensor | None, *linears: nn.Linear) -> bool:
    """Whether the linears' weights are still ``fused``'s row blocks (a ``.to()`` since, or a new
    parameter, would have made them separate tensors again)."""
    if fused is None:
        return False
    row_bytes = fused.element_size() * fused.shape[1]
    start = 0
    for lin in linears:
        if lin.weight.data_ptr() != fused.data_ptr() + start * row_bytes:
            return False
        start += lin.weight.shape[0]
    return True


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


def add_rms_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the norm after it: x, delta [N, H] -> (x + delta, norm(x + delta)).
    One launch in inference on a GPU (``engine.kernels.fused_layers.add_rms_norm``)."""
    if x.dim() == 2 and norm.weight.dtype == x.dtype == delta.dtype and use_fused_kernels(x):
        from engine.kernels.fused_layers import add_rms_norm as fused

        return fused(x, delta, norm.weight, norm.eps)
    total = x + delta
    return total, norm(total)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self._gate_up: torch.Tensor | None = None  # [2I, H] after fuse_projections

    def fuse_projections(self) -> None:
        """Inference: gate and up projections as one GEMM (``fuse_rows``)."""
        if not still_fused(self._gate_up, self.gate_proj, self.up_proj):
            self._gate_up = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if still_fused(self._gate_up, self.gate_proj, self.up_proj):
            assert self._gate_up is not None
            gate_up = F.linear(x, self._gate_up)  # [..., 2I]
            if use_fused_kernels(x):
                from engine.kernels.fused_layers import silu_mul

                return self.down_proj(silu_mul(gate_up))  # silu(gate) * up in one launch
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
