"""Triton kernels of the drafting layer (``engine/model/draft_layer.py``): the RMSNorms it
defers, applied where a row is read anyway.

An RMSNorm is a per-row scale times a per-column weight. The drafting layer folds each weight
into the matrix after it and leaves the row scale ``rsqrt(mean(x^2) + eps)`` to these kernels:

- ``draft_rope_and_store``: from the raw projections ``a = x @ W_qkv_a'^T`` and
  ``qp = a_q @ W_q'^T`` (``W_q`` with W_UK absorbed) of each row, the queries and the latent
  cache entry: ``q_latent = s_q * qp[:, :, :R]``, ``q_rope = rope(s_q * qp[:, :, R:])``, the
  entry ``[w_kv * rms_norm(c_kv) | rope(s_x * k_rope)]``, with ``s_x`` the input's row scale
  (``c_kv`` and ``a_q`` are normalised again, so ``s_x`` reaches only ``k_rope``) and ``s_q`` the
  row scale of ``a_q``: the input norm, the query LoRA's norm, the rotations, the latent norm
  and the cache write in one launch (four in the layer path, plus the copy of ``q_nope``
  its ``q_nope @ W_UK`` made);
- ``scaled_silu_mul``: ``silu(s * gate) * (s * up)`` with ``s`` the row scale of the residual
  stream the gate/up GEMM read: the post-attention norm and the SwiGLU product in one launch.

Both compute in float32 and round once at the store: the drafting layer's numerics are its
own (see its docstring). References: ``draft_rope_and_store_torch`` and
``scaled_silu_mul_torch`` in ``engine/model/draft_layer.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.fused_layers import rope_lanes


@triton.jit
def _row_rstd(ptr, D, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the ``D`` values at ``ptr``."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)


@triton.jit
def _draft_rope_kernel(
    qp_ptr, a_ptr, x_ptr, kvw_ptr, pos_ptr, inv_freq_ptr, q_lat_ptr, q_rope_ptr, cache_ptr, slot_ptr,
    stride_qp, stride_a, stride_x, HEADS, LORA, D, eps_x, eps_q, eps_kv, attention_factor,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_LORA: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    dtype = q_lat_ptr.dtype.element_ty
    a_row = a_ptr + n * stride_a
    s_x = _row_rstd(x_ptr + n * stride_x, D, eps_x, BLOCK_D)
    s_q = _row_rstd(a_row, LORA, eps_q, BLOCK_LORA)
    offs_i = tl.arange(0, HALF)
    freqs = tl.load(pos_ptr + n).to(tl.float32) * tl.load(inv_freq_ptr + offs_i)  # [HALF]
    cos = (tl.cos(freqs) * attention_factor)[None, :]  # [1, HALF]
    sin = (tl.sin(freqs) * attention_factor)[None, :]
    first, second = rope_lanes(HALF, INTERLEAVE)
    # Queries: [s_q * qp[n, h, :R]] and rope(s_q * qp[n, h, R:]) per head.
    offs_h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    h_ok = offs_h < HEADS
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    head_row = qp_ptr + n * stride_qp + offs_h * (R + 2 * HALF)  # [BLOCK_H, 1]
    latent = tl.load(head_row + offs_r[None, :], mask=h_ok & r_ok[None, :], other=0.0).to(tl.float32)
    tl.store(q_lat_ptr + (n * HEADS + offs_h) * R + offs_r[None, :], (latent * s_q).to(dtype),
             mask=h_ok & r_ok[None, :])  # fmt: skip
    x1 = tl.load(head_row + R + first[None, :], mask=h_ok, other=0.0).to(tl.float32) * s_q
    x2 = tl.load(head_row + R + second[None, :], mask=h_ok, other=0.0).to(tl.float32) * s_q
    out_row = q_rope_ptr + (n * HEADS + offs_h) * (2 * HALF)
    tl.store(out_row + offs_i[None, :], (x1 * cos - x2 * sin).to(dtype), mask=h_ok)
    tl.store(out_row + HALF + offs_i[None, :], (x2 * cos + x1 * sin).to(dtype), mask=h_ok)
    # Latent entry: [w_kv * rms_norm(c_kv) | rope(s_x * k_rope)] at the token's flat slot.
    cache_dtype = cache_ptr.dtype.element_ty
    entry = cache_ptr + tl.load(slot_ptr + n).to(tl.int64) * (R + 2 * HALF)
    c = tl.load(a_row + LORA + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    w = tl.load(kvw_ptr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    c = w * c * tl.rsqrt(tl.sum(c * c, axis=0) / R + eps_kv)
    tl.store(entry + offs_r, c.to(cache_dtype), mask=r_ok)
    k1 = tl.load(a_row + LORA + R + first[None, :]).to(tl.float32) * s_x  # [1, HALF]
    k2 = tl.load(a_row + LORA + R + second[None, :]).to(tl.float32) * s_x
    tl.store(entry + R + offs_i[None, :], (k1 * cos - k2 * sin).to(cache_dtype))
    tl.store(entry + R + HALF + offs_i[None, :], (k2 * cos + k1 * sin).to(cache_dtype))


def draft_rope_and_store(
    qp: Tensor,  # [N, heads, R + rope] raw queries (last dim contiguous)
    a: Tensor,  # [N, lora + R + rope] raw qkv_a projection (last dim contiguous)
    x: Tensor,  # [N, H] the layer input, for its row scale (last dim contiguous)
    eps_x: float, eps_q: float,  # the input norm's and the query LoRA norm's
    kv_norm_weight: Tensor, eps_kv: float,  # [R] kv_a_layernorm
    positions: Tensor, inv_freq: Tensor, attention_factor: float, interleave: bool,
    kv_cache: Tensor, slot_mapping: Tensor,  # [blocks, block_size, R + rope] contiguous, [N]
) -> tuple[Tensor, Tensor]:  # q_latent [N, heads, R], q_rope [N, heads, rope]
    N, heads, width = qp.shape
    R = kv_norm_weight.shape[0]
    rope_dim = width - R
    lora = a.shape[1] - R - rope_dim
    half = rope_dim // 2
    assert qp.stride(-1) == 1 and qp.stride(1) == width and a.stride(-1) == 1 and x.stride(-1) == 1
    assert kv_cache.is_contiguous() and triton.next_power_of_2(half) == half
    q_latent = torch.empty(N, heads, R, dtype=qp.dtype, device=qp.device)
    q_rope = torch.empty(N, heads, rope_dim, dtype=qp.dtype, device=qp.device)
    if N:
        _draft_rope_kernel[(N,)](
            qp, a, x, kv_norm_weight, positions, inv_freq, q_latent, q_rope, kv_cache, slot_mapping,
            qp.stride(0), a.stride(0), x.stride(0), heads, lora, x.shape[1], eps_x, eps_q, eps_kv,
            attention_factor, R=R, HALF=half, BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_R=triton.next_power_of_2(R), BLOCK_LORA=triton.next_power_of_2(lora),
            BLOCK_D=triton.next_power_of_2(x.shape[1]), INTERLEAVE=interleave,
        )  # fmt: skip
    return q_latent, q_rope


@triton.jit
def _scaled_silu_mul_kernel(gu_ptr, x_ptr, out_ptr, stride_gu, stride_x, inner, D, eps,
                            BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    s = _row_rstd(x_ptr + row * stride_x, D, eps, BLOCK_D)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inner
    gate = tl.load(gu_ptr + row * stride_gu + col, mask=ok, other=0.0).to(tl.float32) * s
    up = tl.load(gu_ptr + row * stride_gu + inner + col, mask=ok, other=0.0).to(tl.float32) * s
    tl.store(out_ptr + row * inner + col, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=ok)


def scaled_silu_mul(
    gate_up: Tensor,  # [N, 2I] raw gate then up (last dim contiguous)
    x: Tensor,  # [N, H] the rows the GEMM read, for their row scale (last dim contiguous)
    eps: float,
) -> Tensor:  # [N, I]
    N, width = gate_up.shape
    inner = width // 2
    assert gate_up.stride(-1) == 1 and x.stride(-1) == 1 and x.shape[0] == N
    out = torch.empty(N, inner, dtype=gate_up.dtype, device=gate_up.device)
    if N:
        block = min(1024, triton.next_power_of_2(inner))
        _scaled_silu_mul_kernel[(N, triton.cdiv(inner, block))](
            gate_up, x, out, gate_up.stride(0), x.stride(0), inner, x.shape[1], eps,
            BLOCK=block, BLOCK_D=triton.next_power_of_2(x.shape[1]),
        )  # fmt: skip
    return out
