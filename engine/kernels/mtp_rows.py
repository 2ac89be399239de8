"""Fused Triton kernel: the attention inputs of every MTP forward of the graphed tree step.

Each drafting depth of ``engine.spec.graphed_tree`` runs a module over rows whose layout
depends on the sequence's catch-up count ``c``: a precomputed table per ``c`` gives every row's
position, slot-window index, query context and whether it stays in the cache, plus the rows'
mask among themselves (``engine.spec.graphed_rows.RowPlan``). Turning the tables into the forwards' inputs (positions,
cache slots, context lengths, masks, query contexts, the slots to zero afterwards) took ~12
small PyTorch kernels per depth (``RowPlan.inputs_torch``). They depend only on the step's
start (``L``, ``c`` and the slot window), not on any depth's results, so one launch at the
step's start writes them for every depth.

The depths' tables are packed one after another (``pack_row_tables``); ``params[p]`` says where
depth ``p``'s are and where its outputs go. Outputs are depth-major, each depth's rows
sequence-major, so a depth's inputs are contiguous slices: positions, slots, query contexts
and slots to zero ``[B * sum(R)]`` (depth ``p`` at ``B * row_offset[p]``), masks
``[B * sum(R * R)]`` (at ``B * mask_offset[p]``), context lengths ``[P, B]``.

Grid ``(B, P)``: program ``(b, p)`` reads ``L`` and ``c`` of sequence ``b``, then depth ``p``'s
``R`` rows of its table ``c``; integer arithmetic only, so the outputs equal the PyTorch path's
exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _mtp_rows_kernel(
    L_ptr, c_ptr,  # [B] int64: committed target entries (the root's index), catch-up rows
    window_ptr,  # [B, W] int64 flat cache slots of the step's positions window
    meta_ptr,  # packed [C + 1, R, 5] int64 row tables (columns POS, WIN, QON, QOFF, KEEP)
    mask_ptr,  # packed [C + 1, R, R] bool rows' masks
    params_ptr,  # [P, 7] int64 per depth: R, ctx offset, catch-up, meta at, mask at, row offset, mask offset
    pos_ptr, slot_ptr, zero_ptr,  # [B * sum R] int64 out: positions, slots, slots to zero
    ctx_ptr,  # [P, B] int32 out: module entries before the rows
    qctx_ptr,  # [B * sum R] int32 out: query contexts
    new_mask_ptr,  # [B * sum R * R] bool out
    B, W, trash,
    BLOCK_R: tl.constexpr,
    POS: tl.constexpr, WIN: tl.constexpr, QON: tl.constexpr, QOFF: tl.constexpr, KEEP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    prm = params_ptr + p * 7
    R = tl.load(prm + 0)
    ctx_offset = tl.load(prm + 1)
    catch_up = tl.load(prm + 2)
    meta_at = tl.load(prm + 3)
    mask_at = tl.load(prm + 4)
    out_at = B * tl.load(prm + 5) + b * R  # this sequence's first row of depth p
    mask_out_at = B * tl.load(prm + 6) + b * R * R
    L = tl.load(L_ptr + b)
    c = tl.load(c_ptr + b)
    ctx = L - c * catch_up + ctx_offset  # catch-up rows: L - c + offset; none: L + offset
    tl.store(ctx_ptr + p * B + b, ctx.to(tl.int32))
    r = tl.arange(0, BLOCK_R)
    ok = r < R
    row = meta_ptr + meta_at + (c * R + r) * 5
    slot = tl.load(window_ptr + b * W + tl.load(row + WIN, mask=ok, other=0), mask=ok, other=0)
    out = out_at + r
    tl.store(pos_ptr + out, L + tl.load(row + POS, mask=ok, other=0), mask=ok)
    tl.store(slot_ptr + out, slot, mask=ok)
    keep = tl.load(row + KEEP, mask=ok, other=0)
    tl.store(zero_ptr + out, tl.where(keep != 0, trash, slot), mask=ok)
    qctx = ctx * tl.load(row + QON, mask=ok, other=0) + tl.load(row + QOFF, mask=ok, other=0)
    tl.store(qctx_ptr + out, qctx.to(tl.int32), mask=ok)
    both = ok[:, None] & ok[None, :]
    seen = tl.load(mask_ptr + mask_at + (c * R + r[:, None]) * R + r[None, :], mask=both, other=0)
    tl.store(new_mask_ptr + mask_out_at + r[:, None] * R + r[None, :], seen, mask=both)


def pack_row_tables(
    metas: list[Tensor], masks: list[Tensor], ctx_offsets: list[int], catch_ups: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """Depth tables (``metas[p]`` [C + 1, R_p, 5] long, ``masks[p]`` [C + 1, R_p, R_p] bool)
    packed for ``mtp_rows_triton``: (meta, mask, params [P, 7])."""
    params, meta_at, mask_at, row_offset, mask_offset = [], 0, 0, 0, 0
    for meta, mask, off, cu in zip(metas, masks, ctx_offsets, catch_ups, strict=True):
        R = meta.shape[1]
        params.append([R, off, int(cu), meta_at, mask_at, row_offset, mask_offset])
        meta_at, mask_at = meta_at + meta.numel(), mask_at + mask.numel()
        row_offset, mask_offset = row_offset + R, mask_offset + R * R
    dev = metas[0].device
    return (torch.cat([m.reshape(-1) for m in metas]), torch.cat([m.reshape(-1) for m in masks]),
            torch.tensor(params, dtype=torch.long, device=dev))  # fmt: skip


def mtp_rows_triton(
    L: Tensor, c: Tensor, window: Tensor, meta: Tensor, mask: Tensor, params: Tensor, rows: list[int],
    trash: int, columns: tuple[int, int, int, int, int], zero: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Every depth's (positions, slots, ctx lens [P, B], new masks, query ctx lens, slots to
    zero), packed as the module docstring says (``RowPlan.inputs_torch`` per depth);
    ``meta``, ``mask``, ``params``: ``pack_row_tables``'s; ``rows``: each depth's R (as in
    ``params``); ``columns``: the tables' (POS, WIN, QON, QOFF, KEEP) columns; ``zero``: where
    to write the slots to zero ([B * sum R] int64 contiguous; None: a new tensor)."""
    B, W = window.shape
    P, total = len(rows), sum(rows)
    dev = window.device
    pos = torch.empty(B * total, dtype=torch.int64, device=dev)
    slots = torch.empty_like(pos)
    if zero is None:
        zero = torch.empty_like(pos)
    assert zero.shape == pos.shape and zero.dtype == pos.dtype and zero.is_contiguous()
    ctx = torch.empty(P, B, dtype=torch.int32, device=dev)
    qctx = torch.empty(B * total, dtype=torch.int32, device=dev)
    new_mask = torch.empty(B * sum(r * r for r in rows), dtype=torch.bool, device=dev)
    col_pos, col_win, col_qon, col_qoff, col_keep = columns
    _mtp_rows_kernel[(B, P)](
        L, c, window.contiguous(), meta, mask, params, pos, slots, zero, ctx, qctx, new_mask,
        B, W, trash, BLOCK_R=triton.next_power_of_2(max(*rows, 2)),
        POS=col_pos, WIN=col_win, QON=col_qon, QOFF=col_qoff, KEEP=col_keep,
    )  # fmt: skip
    return pos, slots, ctx, new_mask, qctx, zero
