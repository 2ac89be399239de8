"""Triton paged absorbed-MLA attention with per-sequence new-token (tree / causal) masks.

Same contract as ``engine/attention/reference.py`` (docs/internals.md). One program handles
a tile of ``BLOCK_M = BLOCK_Q * BLOCK_H`` rows -- ``BLOCK_Q`` consecutive new tokens of one
sequence times ``BLOCK_H`` heads -- for one split of that sequence's key range:

    grid = (cdiv(H, BLOCK_H), cdiv(M, BLOCK_Q) * num_splits, B)

Head groups vary fastest so the programs that read the same sequence's keys run together and
share them through L2. Row ``m`` of a tile is token ``m // BLOCK_H``, head ``m % BLOCK_H``:
with many heads (H = 128) a tile is one token and 16..64 heads; with few heads (tests, tensor
parallel shards) several tokens of the tree share each key load.

Keys are visited ``BLOCK_N`` positions at a time through the block table (one table load and
32-bit in-page offsets when ``BLOCK_N`` divides the page size, a per-key gather otherwise); each
entry's latent part ``c_kv`` is both key (with ``k_rope``) and value. Scores use an online base-2
softmax with a float32 accumulator ``[BLOCK_M, R]``. Key positions ``>= ctx_b`` are the
sequence's new tokens, gated by ``new_mask``; committed positions are gated by
``query_ctx_lens`` when given.

Work bound: a tile stops at key ``ctx_b + (its last token's index)``, i.e. it assumes new token
``j`` is visible only to new tokens ``i >= j``. Causal prefill masks and tree masks (parents
are stored before children) satisfy this; a mask that lets a token see a *later* one does not.

Split-K: when the grid alone would not fill the GPU (small batch, long context) the key range is
cut into ``num_splits`` chunks; each writes an unnormalised partial ``(acc, m, l)`` to float32
scratch and ``_combine_splits_kernel`` merges them. With one split the output is written
directly.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (keeps exp2 NaN-free)


@triton.jit
def _tree_mla_fwd_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, bt_ptr, ctx_ptr, qs_ptr, mask_ptr, qctx_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale,  # scale * log2(e)
    H, R, P, block_size,
    stride_ql_n, stride_ql_h, stride_qr_n, stride_qr_h,
    stride_kv_blk, stride_kv_off,
    stride_bt_b, stride_mask_n,
    stride_out_n, stride_out_h,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_QCTX: tl.constexpr, DOT_PRECISION: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    head_group = tl.program_id(0)
    q_block = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    seq = tl.program_id(2)

    tok_begin = tl.load(qs_ptr + seq)
    num_new = tl.load(qs_ptr + seq + 1) - tok_begin
    if q_block * BLOCK_Q < num_new:
        offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        q_local = q_block * BLOCK_Q + offs_m // BLOCK_H  # [BLOCK_M] index among new tokens
        heads = head_group * BLOCK_H + offs_m % BLOCK_H  # [BLOCK_M]
        row_ok = (q_local < num_new) & (heads < H)  # [BLOCK_M]
        tok = (tok_begin + q_local).to(tl.int64)  # [BLOCK_M] flat token index n
        offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P]
        r_ok = offs_r < R
        p_ok = offs_p < P

        q_lat = tl.load(
            q_lat_ptr + tok[:, None] * stride_ql_n + heads[:, None] * stride_ql_h + offs_r[None, :],
            mask=row_ok[:, None] & r_ok[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        q_rope = tl.load(
            q_rope_ptr + tok[:, None] * stride_qr_n + heads[:, None] * stride_qr_h
            + offs_p[None, :],
            mask=row_ok[:, None] & p_ok[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_P]

        ctx = tl.load(ctx_ptr + seq)
        if HAS_QCTX:
            committed = tl.load(qctx_ptr + tok, mask=row_ok, other=0)  # [BLOCK_M]
        else:
            committed = tl.zeros([BLOCK_M], dtype=tl.int32) + ctx  # [BLOCK_M]
        # Keys this tile may see: committed ones, then new ones up to its last token.
        last_local = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, num_new)
        kv_len = ctx + last_local
        chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        k_begin = split * chunk
        k_end = tl.minimum(k_begin + chunk, kv_len)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG  # [BLOCK_M] running max (log2)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running denominator
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)  # [BLOCK_M, BLOCK_R]
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt_b
        for start in range(k_begin, k_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            key_ok = pos < k_end
            if TILE_IN_PAGE:
                # The tile lies in one page: one block-table load, 32-bit offsets in the page.
                blk = tl.load(bt_row + start // block_size).to(tl.int64)
                rows_ptr = kv_ptr + blk * stride_kv_blk  # scalar page base
                entry = (start % block_size + tl.arange(0, BLOCK_N)) * stride_kv_off
            else:
                blk = tl.load(bt_row + pos // block_size, mask=key_ok, other=0).to(tl.int64)
                rows_ptr = kv_ptr
                entry = blk * stride_kv_blk + (pos % block_size).to(tl.int64) * stride_kv_off
            k_lat = tl.load(
                rows_ptr + entry[:, None] + offs_r[None, :],
                mask=key_ok[:, None] & r_ok[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_R]: key latent and value
            k_rope = tl.load(
                rows_ptr + entry[:, None] + R + offs_p[None, :],
                mask=key_ok[:, None] & p_ok[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_P]
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
            s = s * qk_scale  # [BLOCK_M, BLOCK_N] log2-domain scores

            j = pos - ctx  # [BLOCK_N] index among new tokens (negative: committed)
            is_new = (j >= 0) & key_ok
            new_seen = tl.load(
                mask_ptr + tok[:, None] * stride_mask_n + j[None, :],
                mask=row_ok[:, None] & is_new[None, :], other=0,
            )  # [BLOCK_M, BLOCK_N] uint8
            old_seen = (pos[None, :] < committed[:, None]) & (j < 0)[None, :]
            visible = key_ok[None, :] & (old_seen | (new_seen != 0))
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION
            )
            m_i = m_new

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_R]
            tl.store(
                out_ptr + tok[:, None] * stride_out_n + heads[:, None] * stride_out_h
                + offs_r[None, :],
                o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :],
            )
        else:
            part = (tok * H + heads) * NUM_SPLITS + split  # [BLOCK_M] partial row
            tl.store(
                part_acc_ptr + part[:, None] * R + offs_r[None, :], acc,
                mask=row_ok[:, None] & r_ok[None, :],
            )
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, H, R, stride_out_n, stride_out_h,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    s_ok = offs_s < NUM_SPLITS
    part = (tok * H + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=_NEG_BIG)  # [BLOCK_S]
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)  # [BLOCK_S]
    w = tl.exp2(m - tl.max(m, axis=0))  # [BLOCK_S] rescale to the common max
    denom = tl.sum(l_s * w, axis=0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * R + offs_r[None, :],
        mask=s_ok[:, None] & (offs_r < R)[None, :], other=0.0,
    )  # [BLOCK_S, BLOCK_R]
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # [BLOCK_R]
    tl.store(
        out_ptr + tok * stride_out_n + head * stride_out_h + offs_r,
        o.to(out_ptr.dtype.element_ty), mask=offs_r < R,
    )


class Tile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int


def default_tile(rank: int) -> Tile:
    """The tile the kernel runs with by default, for latent width ``rank``.

    Up to R = 256 (the ``gpu`` preset): 64 rows, so a sequence's tree tokens share each key load
    (with <= 16 heads a tile holds 4 of them; one-token decode rows are unchanged), 16 keys per
    step and 4 warps. Measured on the H200 at H=12, R=256, context 128
    (``scripts/spec_step_profile.py``, ``bench/results/h200-2026-12-02-session19-profile.json``):
    a 33-node tree at batch 256 211-227 us against 489 for the R=512 tile, at batch 64 78 against
    133; a 5-token chain at batch 256 56 against 82 (135 against 198 at context 400); single-
    token decode rows 46 against 46. Wider latents (DeepSeek-V3's R = 512) keep 16 rows, 32 keys
    and 8 warps: a 64-row accumulator of 512 floats would spill registers."""
    if rank <= 256:
        return Tile(block_m=64, block_n=16, num_warps=4)
    return Tile(block_m=16, block_n=32, num_warps=8)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_num_splits(base_programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Enough key splits to give the GPU ~2 waves of programs, each split >= 4 key blocks."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    if base_programs >= sms:
        return 1
    want = math.ceil(2 * sms / max(base_programs, 1))
    return max(1, min(want, 16, math.ceil(max_keys / (4 * block_n))))


def tree_mla_attention(
    q_latent: Tensor,  # [N, H, R]
    q_rope: Tensor,  # [N, H, P]
    kv_cache: Tensor,  # [num_blocks, block_size, R + P]
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    ctx_lens: Tensor,  # [B] int32
    query_start: Tensor,  # [B + 1] int32
    new_mask: Tensor,  # [N, M] bool
    scale: float,
    query_ctx_lens: Tensor | None = None,  # [N] int32, None = every committed key
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> Tensor:  # [N, H, R] in q_latent's dtype
    """Triton version of ``engine.attention.reference.paged_mla_attention``.

    ``block_m`` (rows per tile, tokens x heads, >= 16), ``block_n`` (keys per step, >= 16),
    ``num_splits`` (key splits; None picks from the grid size), ``num_warps`` and
    ``num_stages`` are tuning knobs that do not change the result beyond rounding; None picks
    ``default_tile``'s. The defaults compile for sm_90 without register spills (R=512, P=64 and
    R=256, P=32; Triton 3.6 and 3.8; checked by ``tests/engine/kernels/test_sm90_compile.py``);
    ``bench/gpu_kernels.py`` and ``scripts/spec_step_profile.py`` time alternatives.
    """
    num_tokens, num_heads, rank = q_latent.shape
    tile = default_tile(rank)
    block_m = tile.block_m if block_m is None else block_m
    block_n = tile.block_n if block_n is None else block_n
    num_warps = tile.num_warps if num_warps is None else num_warps
    rope_dim = q_rope.shape[-1]
    num_seqs, max_new = block_tables.shape[0], new_mask.shape[1]
    block_size = kv_cache.shape[1]
    assert kv_cache.shape[-1] == rank + rope_dim and kv_cache.stride(-1) == 1
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    assert block_m >= 16 and block_n >= 16
    assert kv_cache.dtype == q_latent.dtype == q_rope.dtype
    out = torch.empty(num_tokens, num_heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    block_h = min(triton.next_power_of_2(num_heads), triton.next_power_of_2(block_m))
    block_q = max(1, min(triton.next_power_of_2(block_m) // block_h,
                         triton.next_power_of_2(max_new)))
    block_q = max(block_q, 16 // block_h)  # tl.dot needs >= 16 rows
    head_groups = triton.cdiv(num_heads, block_h)
    q_blocks = triton.cdiv(max_new, block_q)
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size
        num_splits = _pick_num_splits(head_groups * q_blocks * num_seqs, max_keys, block_n,
                                      q_latent.device)
    assert q_blocks * num_splits < 65536 and num_seqs < 65536, "grid too large"

    mask_u8 = new_mask.contiguous().view(torch.uint8)  # [N, M]
    block_tables = block_tables.to(torch.int32)  # [B, max_blocks] (no-op when already int32)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens * num_heads * num_splits, rank,
                               dtype=torch.float32, device=out.device)  # [N*H*S, R]
        part_ml = torch.empty(num_tokens * num_heads * num_splits, 2,
                              dtype=torch.float32, device=out.device)  # [N*H*S, (m, l)]
    else:
        part_acc = part_ml = out  # unused
    qctx = query_ctx_lens.to(torch.int32) if query_ctx_lens is not None else ctx_lens

    grid = (head_groups, q_blocks * num_splits, num_seqs)
    _tree_mla_fwd_kernel[grid](
        q_latent, q_rope, kv_cache, block_tables, ctx_lens.to(torch.int32),
        query_start.to(torch.int32), mask_u8, qctx,
        out, part_acc, part_ml,
        scale * _LOG2E,
        num_heads, rank, rope_dim, block_size,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), mask_u8.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope_dim)),
        NUM_SPLITS=num_splits, HAS_QCTX=query_ctx_lens is not None,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        TILE_IN_PAGE=block_size % block_n == 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, num_heads, rank, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_R=max(16, triton.next_power_of_2(rank)),
            num_warps=4,
        )
    return out
