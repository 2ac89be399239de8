"""Rotary position embedding with DeepSeek-V3's YaRN scaling and softmax-scale correction.

Follows the reference (transformers' `_compute_yarn_parameters`): frequencies blend interpolated
and extrapolated bands with a linear ramp; cos/sin are multiplied by ``attention_factor``; the
softmax scale is multiplied by ``mscale(factor, mscale_all_dim)**2``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.config import ModelConfig, RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    return inv_freq, attention_factor


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), corrected by YaRN's mscale_all_dim as DeepSeek-V3 does."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope.rope_type == "yarn" and cfg.rope.mscale_all_dim:
        m = _yarn_mscale(cfg.rope.factor, float(cfg.rope.mscale_all_dim))
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the rope part of queries and keys (``qk_rope_head_dim`` wide)."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.qk_rope_head_dim
        if cfg.rope.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(cfg.rope, dim)
        else:
            inv_freq = 1.0 / (cfg.rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.attention_factor = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = cfg.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., dim/2] (already scaled by the attention factor)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., dim]; cos/sin broadcastable to [..., dim/2].

        DeepSeek stores rope dims as interleaved pairs (x0, x1), (x2, x3)...; the rotated output
        is laid out de-interleaved (evens then odds), exactly as the reference does. Queries and
        keys use the same layout, so their dot products are unaffected.
        """
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
