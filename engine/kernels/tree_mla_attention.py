"""Triton paged absorbed-MLA attention with per-sequence new-token (tree / causal) masks.

Same contract as ``engine/attention/reference.py`` (docs/internals.md). A sequence's query rows
are its new tokens times ``HEAD_STRIDE`` rows each (row ``r`` is token ``r // HEAD_STRIDE``,
head ``r % HEAD_STRIDE``, a padding row where that is ``>= H``); one program handles a tile of
``BLOCK_M`` consecutive rows for one split of that sequence's key range:

    grid = (cdiv(M * HEAD_STRIDE, BLOCK_M) * num_splits, B)

The tiles of one sequence are adjacent in the grid, so the programs that read the same keys run
together and share them through L2. On a grid that fills the GPU the rows are packed
(``HEAD_STRIDE = H``): with H = 12, a 5-token chain is 60 rows (one 64-row tile, where rows of
16 took two and wasted 40% of them) and a 33-node tree 396 rows (7 tiles, not 9). On a small
grid, whose time is one program's latency, each token's heads are padded to a power of two,
which keeps the tile's row arithmetic cheap enough to stay in registers (``_pack_heads``).
With many heads (H = 128) a 16-row tile is 16 heads of one token either way.

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
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (keeps exp2 NaN-free)


@triton.jit
def _attend_keys(
    acc, m_i, l_i,  # [BLOCK_M, BLOCK_R], [BLOCK_M], [BLOCK_M] running output, max, denominator
    q_lat, q_rope,  # [BLOCK_M, BLOCK_R], [BLOCK_M, BLOCK_P]
    kv_ptr, bt_row, mask_rows, row_ok, committed,
    k_from, k_to, ctx, qk_scale, R, P, block_size, stride_kv_blk, stride_kv_off,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    NEW_KEYS: tl.constexpr, HAS_QCTX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    """Keys ``k_from <= pos < k_to`` into the online softmax, ``BLOCK_N`` at a time from the
    multiple of ``BLOCK_N`` at or below ``k_from`` (so a tile stays in one page). Committed keys
    (``NEW_KEYS`` False) are visible up to each row's ``committed`` (all of them without
    ``HAS_QCTX``); new keys (``pos >= ctx``) through the rows' mask."""
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P]
    r_ok = offs_r < R
    p_ok = offs_p < P
    for start in range(k_from // BLOCK_N * BLOCK_N, k_to, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_ok = (pos >= k_from) & (pos < k_to)
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
        if NEW_KEYS:
            seen = tl.load(
                mask_rows[:, None] + (pos - ctx)[None, :],
                mask=row_ok[:, None] & key_ok[None, :], other=0,
            )  # [BLOCK_M, BLOCK_N] uint8
            visible = key_ok[None, :] & (seen != 0)
        elif HAS_QCTX:
            visible = key_ok[None, :] & (pos[None, :] < committed[:, None])
        else:
            visible = key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tree_mla_fwd_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, bt_ptr, ctx_ptr, qs_ptr, mask_ptr, qctx_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale,  # scale * log2(e)
    H: tl.constexpr, R, P, block_size,
    stride_ql_n, stride_ql_h, stride_qr_n, stride_qr_h,
    stride_kv_blk, stride_kv_off,
    stride_bt_b, stride_mask_n,
    stride_out_n, stride_out_h,
    HEAD_STRIDE: tl.constexpr,  # tile rows per token: H (packed) or a power of two >= H
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_QCTX: tl.constexpr, DOT_PRECISION: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
):
    q_tile = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq = tl.program_id(1)

    tok_begin = tl.load(qs_ptr + seq)
    num_new = tl.load(qs_ptr + seq + 1) - tok_begin
    if q_tile * BLOCK_M < num_new * HEAD_STRIDE:
        row = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token * HEAD_STRIDE + head
        heads = row % HEAD_STRIDE  # [BLOCK_M]
        row_ok = (row < num_new * HEAD_STRIDE) & (heads < H)  # [BLOCK_M]
        tok = (tok_begin + row // HEAD_STRIDE).to(tl.int64)  # [BLOCK_M] flat token index n
        offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P]
        r_ok = offs_r < R

        q_lat = tl.load(
            q_lat_ptr + tok[:, None] * stride_ql_n + heads[:, None] * stride_ql_h + offs_r[None, :],
            mask=row_ok[:, None] & r_ok[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        q_rope = tl.load(
            q_rope_ptr + tok[:, None] * stride_qr_n + heads[:, None] * stride_qr_h
            + offs_p[None, :],
            mask=row_ok[:, None] & (offs_p < P)[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_P]

        ctx = tl.load(ctx_ptr + seq)
        if HAS_QCTX:
            committed = tl.load(qctx_ptr + tok, mask=row_ok, other=0)  # [BLOCK_M]
        else:
            committed = ctx
        # Keys this tile may see: committed ones, then new ones up to its last token. A split
        # takes a chunk of them (a multiple of BLOCK_N keys).
        last_local = tl.minimum((q_tile * BLOCK_M + BLOCK_M - 1) // HEAD_STRIDE + 1, num_new)
        kv_len = ctx + last_local
        chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        k_begin = split * chunk
        k_end = tl.minimum(k_begin + chunk, kv_len)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG  # [BLOCK_M] running max (log2)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running denominator
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)  # [BLOCK_M, BLOCK_R]
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt_b
        mask_rows = mask_ptr + tok * stride_mask_n  # [BLOCK_M] each row's mask over new tokens
        # Committed keys first (no mask to read), then the new tokens through the mask.
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q_lat, q_rope, kv_ptr, bt_row, mask_rows, row_ok, committed,
            k_begin, tl.minimum(k_end, ctx), ctx, qk_scale, R, P, block_size,
            stride_kv_blk, stride_kv_off, BLOCK_N, BLOCK_R, BLOCK_P, False, HAS_QCTX,
            DOT_PRECISION, TILE_IN_PAGE,
        )
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q_lat, q_rope, kv_ptr, bt_row, mask_rows, row_ok, committed,
            tl.maximum(k_begin, ctx), k_end, ctx, qk_scale, R, P, block_size,
            stride_kv_blk, stride_kv_off, BLOCK_N, BLOCK_R, BLOCK_P, True, HAS_QCTX,
            DOT_PRECISION, TILE_IN_PAGE,
        )

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

    Up to R = 256 (the ``gpu`` preset): 64 rows (a 5-token chain's 60 at H = 12, one token's
    heads for decode rows), 16 keys per step and 4 warps. On the H200 at H=12, R=256, page 16
    (``bench/results/h200-2026-12-03-session21-attention.json``), against the kernel before
    rows were packed (head groups padded to 16), same tile: a 5-token chain at batch 256,
    context 128, 35.5 us against 59.4 (74.2 against 136.4 at context 400); a 33-node tree at
    batch 256 193.8 against 228.0, at batch 64 62.4 against 75.6; 9 tokens at batch 256 59.7
    against 79.4; decode rows 44.6 against 49.2. A 128-row tile (32 keys, 8 warps) was faster
    for trees at batch 64-256 (163.6 us at 256) but slower at batches 4-32 in engine steps, and
    spills 2 KB of registers where the MTP rows read per-query contexts. Wider latents
    (DeepSeek-V3's R = 512) keep 16 rows, 32 keys and 8 warps: a 64-row accumulator of 512
    floats would spill heavily."""
    if rank > 256:
        return Tile(block_m=16, block_n=32, num_warps=8)
    return Tile(block_m=64, block_n=16, num_warps=4)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows_per_tile(block_m: int, rows: int) -> int:
    """Rows per tile: a power of two, >= 16 (``tl.dot``), no more than a sequence's ``rows``
    need."""
    return max(16, min(triton.next_power_of_2(block_m), triton.next_power_of_2(rows)))


def _fills_half_the_gpu(programs: int, device: torch.device) -> bool:
    """Whether a grid of ``programs`` occupies at least half the SMs (4 off a GPU): from there
    on the kernel is throughput-bound, below it each program's latency is the time."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    return 2 * programs >= sms


def _pack_heads(num_heads: int, max_new: int, num_seqs: int, block_m: int, device: torch.device) -> bool:
    """Whether to pack query rows token x head: where the packed grid fills half the GPU (no
    key splits: fewer programs, each as dear, is less time). On a smaller grid each program's
    latency is the time, and a power-of-two head count keeps it short: at H = 12 the 64-row
    tile spills 584 bytes of registers at sm_90 packed against 340 with heads padded to 16
    (``tests/engine/kernels/sm90_compile_checks.py``), and on the H200 a batch-1 tree step's
    attention took 12.0 us per call packed against 9.0 with the earlier head-padded kernel
    (``h200-2026-12-03-session21-b1-kernel-sequence.txt``). With a power-of-two head count
    both layouts are the same."""
    if num_heads & (num_heads - 1) == 0:
        return True
    rows = max_new * num_heads
    return _fills_half_the_gpu(triton.cdiv(rows, _rows_per_tile(block_m, rows)) * num_seqs, device)


def _pick_num_splits(base_programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Enough key splits to give the GPU ~2 waves of programs, each split >= 4 key blocks;
    none once the grid fills half the SMs (``max_keys`` is the block tables' capacity, not the
    context, which a captured graph does not know: splits of a short context are mostly the
    combine's overhead; on the H200 a 33-node tree at batch 16, 112 programs, ran 114 us split
    in 3 against 88 unsplit)."""
    if _fills_half_the_gpu(base_programs, device):
        return 1
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
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
    pack_heads: bool | None = None,
) -> Tensor:  # [N, H, R] in q_latent's dtype
    """Triton version of ``engine.attention.reference.paged_mla_attention``.

    ``block_m`` (rows per tile, tokens x heads, >= 16), ``block_n`` (keys per step, >= 16),
    ``num_splits`` (key splits; None picks from the grid size), ``num_warps``, ``num_stages``
    and ``pack_heads`` (rows packed token x head, or each token's heads padded to a power of
    two; None: ``_pack_heads``) are tuning knobs that do not change the result beyond
    rounding; None picks ``default_tile``'s. The defaults compile for sm_90 (R=512, P=64
    without register spills; R=256, P=32 with a few hundred bytes, still the fastest measured;
    Triton 3.6 and 3.8; checked by ``tests/engine/kernels/test_sm90_compile.py``);
    ``bench/gpu_kernels.py`` and ``scripts/spec_step_profile.py`` time alternatives.
    """
    num_tokens, num_heads, rank = q_latent.shape
    num_seqs, max_new = block_tables.shape[0], new_mask.shape[1]
    tile = default_tile(rank)
    block_m = tile.block_m if block_m is None else block_m
    block_n = tile.block_n if block_n is None else block_n
    num_warps = tile.num_warps if num_warps is None else num_warps
    rope_dim = q_rope.shape[-1]
    block_size = kv_cache.shape[1]
    assert kv_cache.shape[-1] == rank + rope_dim and kv_cache.stride(-1) == 1
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    assert block_m >= 16 and block_n >= 16
    assert kv_cache.dtype == q_latent.dtype == q_rope.dtype
    out = torch.empty(num_tokens, num_heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    if pack_heads is None:
        pack_heads = _pack_heads(num_heads, max_new, num_seqs, block_m, q_latent.device)
    head_stride = num_heads if pack_heads else triton.next_power_of_2(num_heads)
    block_m = _rows_per_tile(block_m, max_new * head_stride)
    q_tiles = triton.cdiv(max_new * head_stride, block_m)
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size
        num_splits = _pick_num_splits(q_tiles * num_seqs, max_keys, block_n, q_latent.device)
    assert num_seqs < 65536, "grid too large"

    # A specialisation Triton fails to compile (session 26's H200: the pass
    # TritonGPURemoveLayoutConversions on 16 head rows per token in 9 key splits, which took a
    # whole graphed step down to eager PyTorch, 12 ms a step) is run unsplit instead: the
    # fallback is remembered, so a graph captured after the warm-up records the unsplit launch.
    key = (num_heads, rank, rope_dim, block_size, head_stride, block_m, block_n, num_splits,
           query_ctx_lens is not None, q_latent.dtype, num_warps, num_stages)  # fmt: skip
    if num_splits > 1 and key in _UNCOMPILABLE:
        num_splits = 1
    try:
        _launch_fwd(q_latent, q_rope, kv_cache, block_tables, ctx_lens, query_start, new_mask, query_ctx_lens,
                    out, scale, head_stride, block_m, block_n, q_tiles, num_splits, num_warps, num_stages)
    except Exception as exc:  # a compile failure of this specialisation, on its first launch
        if num_splits == 1 or key in _COMPILED:
            raise
        warnings.warn(f"tree_mla_attention: {type(exc).__name__} compiling {num_splits} key splits "
                      f"(head rows {head_stride}, block_m {block_m}); running unsplit", stacklevel=2)
        _UNCOMPILABLE.add(key)
        _launch_fwd(q_latent, q_rope, kv_cache, block_tables, ctx_lens, query_start, new_mask, query_ctx_lens,
                    out, scale, head_stride, block_m, block_n, q_tiles, 1, num_warps, num_stages)
        return out
    _COMPILED.add(key)
    return out


_COMPILED: set[tuple[object, ...]] = set()  # specialisations launched once (compiled)
_UNCOMPILABLE: set[tuple[object, ...]] = set()  # split specialisations Triton failed to compile


def _launch_fwd(
    q_latent: Tensor, q_rope: Tensor, kv_cache: Tensor, block_tables: Tensor, ctx_lens: Tensor,
    query_start: Tensor, new_mask: Tensor, query_ctx_lens: Tensor | None, out: Tensor, scale: float,
    head_stride: int, block_m: int, block_n: int, q_tiles: int, num_splits: int, num_warps: int,
    num_stages: int,
) -> None:
    """The attention kernel (and the splits' combine) into ``out`` [N, H, R]."""
    num_tokens, num_heads, rank = out.shape
    rope_dim = q_rope.shape[-1]
    block_size = kv_cache.shape[1]
    num_seqs = ctx_lens.shape[0]
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
    grid = (q_tiles * num_splits, num_seqs)
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
        HEAD_STRIDE=head_stride, BLOCK_M=block_m, BLOCK_N=block_n,
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
