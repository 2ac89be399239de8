"""Fused Triton kernel: the attention inputs of one MTP forward of the graphed tree step.

Each drafting depth of ``engine.spec.graphed_tree`` runs a module over rows whose layout
depends on the sequence's catch-up count ``c``: a precomputed table per ``c`` gives every row's
position, slot-window index, query context and whether it stays in the cache, plus the rows'
mask among themselves (``_RowPlan``). Turning the table into the forward's inputs (positions,
cache slots, context lengths, mask, query contexts, the slots to zero afterwards) took ~12 small
PyTorch kernels per depth (``_RowPlan.inputs_torch``); here it is one.

Grid ``(B,)``: program ``b`` reads ``L`` and ``c`` of sequence ``b``, then its ``R`` rows of
table ``c`` and writes their inputs; integer arithmetic only, so the outputs equal the PyTorch
path's exactly.
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
    meta_ptr,  # [C + 1, R, 5] int64 row table per c (columns POS, WIN, QON, QOFF, KEEP)
    mask_ptr,  # [C + 1, R, R] bool rows' mask per c
    pos_ptr, slot_ptr, zero_ptr,  # [B * R] int64 out: positions, slots, slots to zero
    ctx_ptr, qctx_ptr,  # [B] int32 out: module entries before the rows; [B * R] int32 query contexts
    new_mask_ptr,  # [B * R, R] bool out
    W, trash, ctx_offset,
    CATCH_UP: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    POS: tl.constexpr, WIN: tl.constexpr, QON: tl.constexpr, QOFF: tl.constexpr, KEEP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    L = tl.load(L_ptr + b)
    c = tl.load(c_ptr + b)
    if CATCH_UP:
        ctx = L - c + ctx_offset
    else:
        ctx = L + ctx_offset
    tl.store(ctx_ptr + b, ctx.to(tl.int32))
    r = tl.arange(0, BLOCK_R)
    ok = r < R
    row = meta_ptr + (c * R + r) * 5
    slot = tl.load(window_ptr + b * W + tl.load(row + WIN, mask=ok, other=0), mask=ok, other=0)
    out = b * R + r
    tl.store(pos_ptr + out, L + tl.load(row + POS, mask=ok, other=0), mask=ok)
    tl.store(slot_ptr + out, slot, mask=ok)
    keep = tl.load(row + KEEP, mask=ok, other=0)
    tl.store(zero_ptr + out, tl.where(keep != 0, trash, slot), mask=ok)
    qctx = ctx * tl.load(row + QON, mask=ok, other=0) + tl.load(row + QOFF, mask=ok, other=0)
    tl.store(qctx_ptr + out, qctx.to(tl.int32), mask=ok)
    both = ok[:, None] & ok[None, :]
    seen = tl.load(mask_ptr + (c * R + r[:, None]) * R + r[None, :], mask=both, other=0)
    tl.store(new_mask_ptr + out[:, None] * R + r[None, :], seen, mask=both)


def mtp_rows_triton(
    L: Tensor, c: Tensor, window: Tensor, meta: Tensor, mask: Tensor, trash: int, ctx_offset: int,
    catch_up: bool, columns: tuple[int, int, int, int, int], zero: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(positions, slots, ctx lens, new mask, query ctx lens, slots to zero), as
    ``_RowPlan.inputs_torch``; ``columns``: the table's (POS, WIN, QON, QOFF, KEEP) columns;
    ``zero``: where to write the slots to zero ([B * R] int64 contiguous; None: a new tensor)."""
    B, W = window.shape
    R = meta.shape[1]
    dev = window.device
    pos = torch.empty(B * R, dtype=torch.int64, device=dev)
    slots = torch.empty_like(pos)
    if zero is None:
        zero = torch.empty_like(pos)
    assert zero.shape == pos.shape and zero.dtype == pos.dtype and zero.is_contiguous()
    ctx = torch.empty(B, dtype=torch.int32, device=dev)
    qctx = torch.empty(B * R, dtype=torch.int32, device=dev)
    new_mask = torch.empty(B * R, R, dtype=torch.bool, device=dev)
    col_pos, col_win, col_qon, col_qoff, col_keep = columns
    _mtp_rows_kernel[(B,)](
        L, c, window.contiguous(), meta, mask, pos, slots, zero, ctx, qctx, new_mask,
        W, trash, ctx_offset, CATCH_UP=catch_up, R=R, BLOCK_R=triton.next_power_of_2(max(R, 2)),
        POS=col_pos, WIN=col_win, QON=col_qon, QOFF=col_qoff, KEEP=col_keep,
    )  # fmt: skip
    return pos, slots, ctx, new_mask, qctx, zero
