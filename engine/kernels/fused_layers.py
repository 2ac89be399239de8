"""Fused Triton kernels for the per-token pieces of a decoder layer (one launch each).

On a GPU a decode step of a small model is bound by kernel launches, not by bytes or FLOPs: an
RMSNorm in PyTorch is four kernels (cast, normalise, cast back, weight), RoPE on queries and
keys plus the latent-cache write about sixteen. These kernels do each in one launch:

- ``rms_norm``: ``weight * rms_norm(x.float()).to(x.dtype)`` per row;
- ``rope_and_store_latent``: per token, computes cos/sin of its position, rotates the rope part
  of every head's query into a new tensor, and normalises ``c_kv``, rotates ``k_rope`` and
  stores ``[c_kv | k_rope]`` at the token's cache slot;
- ``add_rms_norm``: the residual add and the next norm, ``s = x + delta``, ``weight *
  rms_norm(s)`` (two kernels in PyTorch, at every residual of every layer);
- ``silu_mul``: the SwiGLU MLP's ``silu(gate) * up`` from the fused gate/up projection's output
  (two kernels in PyTorch);
- ``mtp_input``: an MTP module's input before ``eh_proj``, ``[enorm(embed(x)) | hnorm(h)]`` per
  row: the embedding lookup, both norms and the concatenation (four kernels) in one launch, at
  each of the drafting depths (the autoregressive step runs none of them); ``mtp_input_parts``
  reads the rows from the parts they come in, without concatenating them first.

Both round where the PyTorch path rounds (after the normalisation, cos/sin, each product of
the rotation), so in bfloat16 they agree with it to the last bit but for the order of the fp32
reduction and the last bit of fp32 cos/sin. References (the PyTorch path): ``RMSNorm`` in
``engine/model/layers.py``, ``MultiHeadLatentAttention._rope_and_store_latent`` in
``engine/model/mla.py``, ``MTPLayer.fuse_inputs`` in ``engine/model/decoder_layer.py`` and
``SwiGLUMLP``'s unfused forward; tests: ``tests/engine/kernels/fused_cases.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """Round float32 ``x`` to the tensor dtype and back (the PyTorch path's rounding points)."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norm_row(x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    """Store ``weight * rms_norm(row)`` of the ``D`` values at ``x_ptr`` to ``out_ptr``."""
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = _round(x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps), dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (w * normed).to(dtype), mask=ok)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _norm_row(x_ptr + row * stride_x, w_ptr, out_ptr + row * D, D, eps, BLOCK)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] (last dim contiguous) -> [..., D] in x's dtype."""
    D = x.shape[-1]
    rows = x.reshape(-1, D) if x.dim() != 2 else x  # a view whenever the rows are evenly strided
    assert rows.stride(-1) == 1
    out = torch.empty(rows.shape[0], D, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), D, eps, BLOCK=triton.next_power_of_2(D)
        )
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_d, D, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + offs, mask=ok, other=0.0).to(tl.float32)
    total = _round(x + d, dtype)  # the residual stream, rounded as the PyTorch add rounds it
    tl.store(sum_ptr + row * D + offs, total.to(dtype), mask=ok)
    normed = _round(total * tl.rsqrt(tl.sum(total * total, axis=0) / D + eps), dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (w * normed).to(dtype), mask=ok)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, delta [N, D] (last dim contiguous) -> (x + delta, weight * rms_norm(x + delta)), new
    tensors in x's dtype."""
    N, D = x.shape
    assert delta.shape == x.shape and x.stride(-1) == 1 and delta.stride(-1) == 1
    total = torch.empty(N, D, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if N:
        _add_rms_norm_kernel[(N,)](x, delta, weight, total, out, x.stride(0), delta.stride(0), D, eps,
                                   BLOCK=triton.next_power_of_2(D))  # fmt: skip
    return total, out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inner
    gate = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + col, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * inner + col, (silu * up).to(dtype), mask=ok)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2I] (gate, then up; last dim contiguous) -> silu(gate) * up [..., I]."""
    width = gate_up.shape[-1]
    assert width % 2 == 0 and gate_up.stride(-1) == 1
    rows = gate_up.reshape(-1, width) if gate_up.dim() != 2 else gate_up
    inner = width // 2
    out = torch.empty(rows.shape[0], inner, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(inner))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inner, block))](
            rows, out, rows.stride(0), inner, BLOCK=block
        )
    return out.view(*gate_up.shape[:-1], inner)


@triton.jit
def _mtp_input_kernel(
    tok0_ptr, tok1_ptr, stride_t0, stride_t1, T0,  # token parts [B, T_i] (columns contiguous)
    prev0_ptr, prev1_ptr, prev2_ptr,  # hidden parts [B, P_i, H] (last dim contiguous)
    stride_p0b, stride_p0r, stride_p1b, stride_p1r, stride_p2b, stride_p2r, P0, P1,
    emb_ptr, ew_ptr, hw_ptr, out_ptr,  # [V, H], [H], [H], [B * R, 2H]
    R, stride_emb, D, eps_e, eps_h, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // R
    j = row % R
    if j < T0:
        token = tl.load(tok0_ptr + b * stride_t0 + j)
    else:
        token = tl.load(tok1_ptr + b * stride_t1 + (j - T0))
    if j < P0:
        prev = prev0_ptr + b * stride_p0b + j * stride_p0r
    elif j < P0 + P1:
        prev = prev1_ptr + b * stride_p1b + (j - P0) * stride_p1r
    else:
        prev = prev2_ptr + b * stride_p2b + (j - P0 - P1) * stride_p2r
    out_row = out_ptr + row * 2 * D
    _norm_row(emb_ptr + token.to(tl.int64) * stride_emb, ew_ptr, out_row, D, eps_e, BLOCK)
    _norm_row(prev, hw_ptr, out_row + D, D, eps_h, BLOCK)


def mtp_input(
    input_ids: Tensor,  # [N] token of each row
    embed_weight: Tensor,  # [V, H] the shared embedding
    prev_hidden: Tensor,  # [N, H] the previous depth's hidden (last dim contiguous)
    enorm_weight: Tensor,  # [H]
    enorm_eps: float,
    hnorm_weight: Tensor,  # [H]
    hnorm_eps: float,
) -> Tensor:  # [N, 2H] [enorm(embed(input_ids)) | hnorm(prev_hidden)] in prev_hidden's dtype
    return mtp_input_parts([input_ids[None]], [prev_hidden[None]], embed_weight, enorm_weight, enorm_eps,
                           hnorm_weight, hnorm_eps)  # fmt: skip


def mtp_input_parts(
    token_parts: list[Tensor],  # 1 or 2 of [B, T_i] int64, columns contiguous
    prev_parts: list[Tensor],  # 1 to 3 of [B, P_i, H], last dim contiguous
    embed_weight: Tensor,  # [V, H]
    enorm_weight: Tensor,  # [H]
    enorm_eps: float,
    hnorm_weight: Tensor,  # [H]
    hnorm_eps: float,
) -> Tensor:  # [B * R, 2H], R = sum T_i = sum P_i
    """``mtp_input`` of the rows ``cat(token_parts, 1)`` / ``cat(prev_parts, 1)`` [B, R, ...],
    read where each part lies: row ``j`` of sequence ``b`` takes its token from part 0's column
    ``j`` or part 1's column ``j - T0``, its previous hidden state from part 0's row ``j``, part
    1's row ``j - P0`` or part 2's row ``j - P0 - P1``. Every part has its own batch and row
    strides (a row stride of 0 repeats one row). A drafting depth of the graphed tree step
    (``engine.spec.graphed_tree``) has its rows in such parts (catch-up and frontier tokens; the
    carried row, the previous depth's outputs, the frontier's rows): concatenating them first
    took two kernels per depth."""
    assert 1 <= len(token_parts) <= 2 and 1 <= len(prev_parts) <= 3
    B = prev_parts[0].shape[0]
    H = prev_parts[0].shape[-1]
    R = sum(p.shape[1] for p in prev_parts)
    assert sum(t.shape[1] for t in token_parts) == R and embed_weight.stride(-1) == 1
    assert all(t.stride(-1) == 1 for t in token_parts) and all(p.stride(-1) == 1 for p in prev_parts)
    toks = [*token_parts, token_parts[-1]][:2]  # unused parts: any valid tensor (never read)
    prevs = [*prev_parts, prev_parts[-1], prev_parts[-1]][:3]
    counts = [p.shape[1] for p in prev_parts] + [0, 0]
    out = torch.empty(B * R, 2 * H, dtype=prev_parts[0].dtype, device=prev_parts[0].device)
    if B * R:
        _mtp_input_kernel[(B * R,)](
            toks[0], toks[1], toks[0].stride(0), toks[1].stride(0), token_parts[0].shape[1],
            prevs[0], prevs[1], prevs[2],
            prevs[0].stride(0), prevs[0].stride(1), prevs[1].stride(0), prevs[1].stride(1),
            prevs[2].stride(0), prevs[2].stride(1), counts[0], counts[1],
            embed_weight, enorm_weight, hnorm_weight, out,
            R, embed_weight.stride(0), H, enorm_eps, hnorm_eps, BLOCK=triton.next_power_of_2(H),
        )  # fmt: skip
    return out


@triton.jit
def rope_lanes(HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The offsets of the rotated pairs' first and second halves in a rope part of ``2 * HALF``:
    (x0, x1), (x2, x3)... when interleaved, else (x_i, x_{HALF + i})."""
    offs_i = tl.arange(0, HALF)
    if INTERLEAVE:
        first = 2 * offs_i
        second = first + 1
    else:
        first = offs_i
        second = offs_i + HALF
    return first, second


@triton.jit
def _rotate(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin), every product and sum rounded like the torch path."""
    a = _round(_round(x1 * cos, DTYPE) - _round(x2 * sin, DTYPE), DTYPE)
    b = _round(_round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE), DTYPE)
    return a, b


@triton.jit
def _rope_latent_kernel(
    q_ptr, kv_ptr, w_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, cache_ptr, slot_ptr,
    stride_qn, stride_qh, stride_kvn, H, eps, attention_factor,
    NOPE: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    cache_dtype = cache_ptr.dtype.element_ty
    offs_i = tl.arange(0, HALF)
    # cos/sin of the token's position, as RotaryEmbedding.cos_sin computes and rounds them.
    freqs = tl.load(pos_ptr + n).to(tl.float32) * tl.load(inv_freq_ptr + offs_i)  # [HALF]
    cos = _round(tl.cos(freqs) * attention_factor, dtype)[None, :]  # [1, HALF]
    sin = _round(tl.sin(freqs) * attention_factor, dtype)[None, :]
    first, second = rope_lanes(HALF, INTERLEAVE)
    # Queries: q[n, h, NOPE:] -> q_out[n, h, :] (evens then odds when interleaved).
    offs_h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    h_ok = offs_h < H
    q_row = q_ptr + n * stride_qn + offs_h * stride_qh + NOPE
    x1 = tl.load(q_row + first[None, :], mask=h_ok, other=0.0).to(tl.float32)
    x2 = tl.load(q_row + second[None, :], mask=h_ok, other=0.0).to(tl.float32)
    a, b = _rotate(x1, x2, cos, sin, dtype)
    out_row = q_out_ptr + (n * H + offs_h) * (2 * HALF)
    tl.store(out_row + offs_i[None, :], a.to(dtype), mask=h_ok)
    tl.store(out_row + HALF + offs_i[None, :], b.to(dtype), mask=h_ok)
    # Latent entry: [rms_norm(c_kv) * w | rotated k_rope] at the token's flat cache slot.
    slot = tl.load(slot_ptr + n).to(tl.int64)
    kv_row = kv_ptr + n * stride_kvn
    entry = cache_ptr + slot * (R + 2 * HALF)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    c = tl.load(kv_row + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(c * c, axis=0) / R + eps)
    w = tl.load(w_ptr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    c = w * _round(c * rstd, dtype)
    tl.store(entry + offs_r, c.to(dtype).to(cache_dtype), mask=r_ok)
    k1 = tl.load(kv_row + R + first[None, :]).to(tl.float32)  # [1, HALF]
    k2 = tl.load(kv_row + R + second[None, :]).to(tl.float32)
    ka, kb = _rotate(k1, k2, cos, sin, dtype)
    tl.store(entry + R + offs_i[None, :], ka.to(dtype).to(cache_dtype))
    tl.store(entry + R + HALF + offs_i[None, :], kb.to(dtype).to(cache_dtype))


def rope_and_store_latent(
    q: Tensor,  # [N, heads, nope + rope] (last dim contiguous)
    kv: Tensor,  # [N, kv_rank + rope] output of kv_a_proj_with_mqa (last dim contiguous)
    norm_weight: Tensor,  # [kv_rank] kv_a_layernorm weight
    eps: float,
    positions: Tensor,  # [N] RoPE position of each token
    inv_freq: Tensor,  # [rope/2] float32
    attention_factor: float,
    kv_cache: Tensor,  # [num_blocks, block_size, kv_rank + rope] one layer, contiguous
    slot_mapping: Tensor,  # [N] flat slots
    nope_dim: int,
    interleave: bool,
) -> Tensor:  # [N, heads, rope] rotated query rope part
    N, H, _ = q.shape
    rope_dim = q.shape[-1] - nope_dim
    rank = kv.shape[-1] - rope_dim
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and kv_cache.is_contiguous()
    assert rope_dim % 2 == 0 and triton.next_power_of_2(rope_dim // 2) == rope_dim // 2
    q_rope = torch.empty(N, H, rope_dim, dtype=q.dtype, device=q.device)
    if N:
        _rope_latent_kernel[(N,)](
            q, kv, norm_weight, positions, inv_freq, q_rope, kv_cache, slot_mapping,
            q.stride(0), q.stride(1), kv.stride(0), H, eps, attention_factor,
            NOPE=nope_dim, HALF=rope_dim // 2, R=rank, BLOCK_H=triton.next_power_of_2(H),
            BLOCK_R=triton.next_power_of_2(rank), INTERLEAVE=interleave,
        )
    return q_rope
