"""Fused Triton kernels for the bookkeeping around the graphed tree step's forwards.

The graphed tree step (``engine.spec.graphed_tree``) turns its static inputs into the flat cache
slots of the step's positions window at its start, zeroes the drafts its MTP forwards left in
the cache, and at its end turns its outputs into the next step's inputs. As PyTorch ops that is
~50 kernels of one or two microseconds each per step, as many at batch 1 as at 256, and on the
H200 they are launch-bound: a few percent of a batch-1 step. Here they are five kernels (six
launches: the zeroing runs for the drafts and for the scratch):

- ``step_start_triton``: the window's flat slots [B, W] from the block tables, each
  sequence's last catch-up row and the tree's root token (10 kernels);
- ``verify_inputs_triton``: the verify forward's positions, context lengths and tree slots
  (3 kernels);
- ``zero_cache_rows_triton``: zero given (layer, slot) rows of the cache, e.g. every depth's
  drafts at once (one ``index_fill_`` per depth before) or the scratch blocks (4 kernels);
- ``write_outputs_triton``: the packed results for the host, module 1's next rows and the
  rollback's path (~10 kernels);
- ``advance_triton``: the next step's catch-up tokens, ``L``, ``c``, module-1 rows and carried
  rows from the step's outputs (17 kernels).

Integer arithmetic and copies only: the outputs equal the PyTorch path's exactly. That path (the
CPU's) lives in ``engine.spec.graphed_tree`` as the reference the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _step_start_kernel(
    tables_ptr, L_ptr, c_ptr, tail_ptr, offsets_ptr,  # [B, M] int32, [B], [B], [B, C], [W] int64
    window_ptr, last_ptr, root_ptr,  # out: [B, W], [B], [B] int64
    M, C, W, BLOCK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    ok = w < W
    pos = tl.maximum(tl.load(L_ptr + b) + tl.load(offsets_ptr + w, mask=ok, other=0), 0)  # [BLOCK_W]
    column = pos // BLOCK_SIZE  # within the table (the step's capacity checks)
    block = tl.load(tables_ptr + b * M + column, mask=ok & (column < M), other=0).to(tl.int64)
    tl.store(window_ptr + b * W + w, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=ok)
    last = tl.load(c_ptr + b) - 1
    tl.store(last_ptr + b, last)
    tl.store(root_ptr + b, tl.load(tail_ptr + b * C + last))


def step_start_triton(
    tables: Tensor, L: Tensor, c: Tensor, tail: Tensor, offsets: Tensor, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The step's start, as ``GraphedTreeStep._step_start_torch``: the flat cache slots [B, W]
    of positions ``max(L[b] + offsets[w], 0)`` through the block ``tables`` [B, max_blocks]
    (int32, contiguous), each sequence's last catch-up row ``c - 1`` [B] and its token, the
    tree's root ``tail[b, c - 1]`` [B]. ``L``, ``c`` [B], ``tail`` [B, C], ``offsets`` [W] int64."""
    B, M = tables.shape
    W, C = offsets.shape[0], tail.shape[1]
    assert tail.is_contiguous()
    window = torch.empty(B, W, dtype=torch.int64, device=tables.device)
    last = torch.empty(B, dtype=torch.int64, device=tables.device)
    root = torch.empty_like(last)
    _step_start_kernel[(B,)](tables, L, c, tail, offsets, window, last, root, M, C, W,
                             BLOCK_SIZE=block_size, BLOCK_W=triton.next_power_of_2(W))  # fmt: skip
    return window, last, root


@triton.jit
def _verify_inputs_kernel(
    L_ptr, depth_ptr, window_ptr,  # [B] int64, [B, NODES] int64 (batch stride STRIDE_DEPTH), [B, W]
    pos_ptr, slots_ptr, ctx_ptr,  # out: [B * NODES] int64, [B, NODES] int64, [B] int32
    NODES, W, WINDOW_START, STRIDE_DEPTH, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    ok = t < NODES
    L = tl.load(L_ptr + b)
    depth = tl.load(depth_ptr + b * STRIDE_DEPTH + t, mask=ok, other=0)
    tl.store(pos_ptr + b * NODES + t, L + depth, mask=ok)
    tl.store(slots_ptr + b * NODES + t, tl.load(window_ptr + b * W + WINDOW_START + t, mask=ok, other=0), mask=ok)
    tl.store(ctx_ptr + b, L.to(tl.int32))


def verify_inputs_triton(
    L: Tensor, depth: Tensor, window: Tensor, window_start: int, tree_slots: Tensor
) -> tuple[Tensor, Tensor]:
    """The verify forward's inputs, as ``GraphedTreeStep._verify_inputs_torch``: positions
    ``L + depth`` [B * (N+1)] and context lengths ``L`` [B] int32, returned; the tree's slots
    ``window[:, window_start : window_start + N + 1]`` written into ``tree_slots`` [B, N+1]
    (contiguous: the forward's slot mapping and the rollback's input). ``depth`` [B, N+1] may
    repeat one row (batch stride 0)."""
    B, nodes = depth.shape
    assert depth.stride(1) == 1 and tree_slots.is_contiguous() and tree_slots.shape == (B, nodes)
    assert window.is_contiguous() and window_start + nodes <= window.shape[1]
    positions = torch.empty(B * nodes, dtype=torch.int64, device=L.device)
    ctx = torch.empty(B, dtype=torch.int32, device=L.device)
    _verify_inputs_kernel[(B,)](L, depth, window, positions, tree_slots, ctx, nodes, window.shape[1],
                                window_start, depth.stride(0), BLOCK_T=triton.next_power_of_2(nodes))  # fmt: skip
    return positions, ctx


@triton.jit
def _zero_cache_rows_kernel(
    kv_ptr, layer_ptr, slot_ptr,  # [layers, slots, D]; [n] int64 each
    n, stride_layer, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    n_ok = offs_n < n
    layer = tl.load(layer_ptr + offs_n, mask=n_ok, other=0)
    slot = tl.load(slot_ptr + offs_n, mask=n_ok, other=0)
    row = kv_ptr + layer * stride_layer + slot * D  # [BLOCK_N] row starts
    zeros = tl.zeros([BLOCK_N, BLOCK_D], dtype=kv_ptr.dtype.element_ty)
    tl.store(row[:, None] + offs_d[None, :], zeros, mask=n_ok[:, None] & (offs_d < D)[None, :])


def zero_cache_rows_triton(kv_cache_all: Tensor, layers: Tensor, slots: Tensor) -> bool:
    """``kv_cache_all[layers[i]].flat_slot(slots[i]) = 0`` for every ``i`` (one launch).

    ``kv_cache_all`` [L, num_blocks, block_size, D] contiguous; ``layers``, ``slots`` [n] int64.
    Repeated rows are fine (every write is a zero). Returns True (launched: ``run_kernel``)."""
    assert kv_cache_all.is_contiguous() and layers.shape == slots.shape
    n, D = slots.numel(), kv_cache_all.shape[-1]
    if n == 0:
        return True
    block_n = min(32, triton.next_power_of_2(n))
    block_d = min(256, triton.next_power_of_2(D))
    grid = (triton.cdiv(n, block_n), triton.cdiv(D, block_d))
    _zero_cache_rows_kernel[grid](kv_cache_all, layers, slots, n, kv_cache_all.stride(0), D,
                                  BLOCK_N=block_n, BLOCK_D=block_d)  # fmt: skip
    return True


@triton.jit
def _advance_kernel(
    packed_ptr,  # [B, PACKED] int64: accepted count, bonus, path tokens (root first), ...
    live_ptr,  # [B] bool
    tail_ptr, L_ptr, c_ptr,  # [B, C], [B], [B] int64, updated for live rows
    next_rows_ptr, rows0_ptr,  # [B, P, H] -> [B, C, H] (rows 0..P-1)
    next_carry_ptr, carry_ptr,  # [B, K1, H] -> [B, K1, H]
    PACKED, C, H, K1,
    D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = packed_ptr + b * PACKED
    a = tl.load(row)
    bonus = tl.load(row + 1)
    live = tl.load(live_ptr + b) != 0
    j = tl.arange(0, BLOCK_C)
    j_ok = j < C
    accepted = tl.load(row + 3 + tl.minimum(j, D - 1), mask=j_ok, other=0)  # path below the root
    tail = tl.where(j < a, accepted, tl.where(j == a, bonus, 0))
    tl.store(tail_ptr + b * C + j, tail, mask=j_ok & live)
    L = tl.load(L_ptr + b)
    tl.store(L_ptr + b, tl.where(live, L + a + 1, L))
    c = tl.load(c_ptr + b)
    tl.store(c_ptr + b, tl.where(live, a + 1, c))
    # Module 1's rows: the accepted path's verify states; the carry: each module's last row.
    offs = tl.arange(0, BLOCK)
    n_rows = (D + 1) * H
    for start in range(0, n_rows, BLOCK):
        i = start + offs
        ok = i < n_rows
        tl.store(rows0_ptr + b * C * H + i, tl.load(next_rows_ptr + b * n_rows + i, mask=ok), mask=ok)
    n_carry = K1 * H
    for start in range(0, n_carry, BLOCK):
        i = start + offs
        ok = i < n_carry
        tl.store(carry_ptr + b * n_carry + i, tl.load(next_carry_ptr + b * n_carry + i, mask=ok), mask=ok)


def advance_triton(
    packed: Tensor, live: Tensor, tail: Tensor, L: Tensor, c: Tensor,
    next_rows: Tensor, rows0: Tensor, next_carry: Tensor, carry: Tensor, depth: int,
) -> bool:
    """In place, as ``GraphedTreeStep._advance_torch``: live rows take ``L += a + 1``,
    ``c = a + 1`` and the accepted tokens and bonus as catch-up tokens; every row's module-1 rows
    ``rows0[:, :P]`` and carried rows become the step's ``next_rows`` and ``next_carry``.
    Returns True (launched: ``run_kernel``)."""
    for t in (packed, tail, next_rows, rows0, next_carry, carry):
        assert t.is_contiguous()
    B, C = tail.shape
    H = rows0.shape[-1]
    assert next_rows.shape == (B, depth + 1, H) and rows0.shape[1] >= depth + 1
    _advance_kernel[(B,)](
        packed, live, tail, L, c, next_rows, rows0, next_carry, carry,
        packed.shape[1], C, H, carry.shape[1],
        D=depth, BLOCK_C=triton.next_power_of_2(max(C, 2)), BLOCK=1024,
    )  # fmt: skip
    return True


@triton.jit
def _write_outputs_kernel(
    num_ptr, bonus_ptr, path_ptr, child_ptr, rank_ptr, keep_ptr,  # the accepted path [B, 1] / [B, P]
    tok_ptr, hidden_ptr,  # [B, N+1] tree tokens, [B, N+1, H] verify states
    packed_ptr, next_rows_ptr, path_out_ptr, keep_out_ptr,  # outputs
    NODES, H, PACKED,
    P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_P)
    d_ok = d < P
    node = tl.load(path_ptr + b * P + d, mask=d_ok, other=0)  # [BLOCK_P]
    row = packed_ptr + b * PACKED
    tl.store(row, tl.load(num_ptr + b))
    tl.store(row + 1, tl.load(bonus_ptr + b))
    tl.store(row + 2 + d, tl.load(tok_ptr + b * NODES + node, mask=d_ok, other=0), mask=d_ok)
    tl.store(row + 2 + P + d, tl.load(child_ptr + b * P + d, mask=d_ok, other=0).to(tl.int64), mask=d_ok)
    tl.store(row + 2 + 2 * P + d, tl.load(rank_ptr + b * P + d, mask=d_ok, other=0).to(tl.int64), mask=d_ok)
    tl.store(path_out_ptr + b * P + d, node, mask=d_ok)
    tl.store(keep_out_ptr + b * P + d, tl.load(keep_ptr + b * P + d, mask=d_ok, other=0), mask=d_ok)
    # Module 1's next rows: the verify states of the path's nodes.
    h = tl.arange(0, BLOCK_H)
    for j in tl.static_range(P):
        src = tl.load(path_ptr + b * P + j)
        for h0 in range(0, H, BLOCK_H):
            h_ok = h0 + h < H
            x = tl.load(hidden_ptr + (b * NODES + src) * H + h0 + h, mask=h_ok)
            tl.store(next_rows_ptr + (b * P + j) * H + h0 + h, x, mask=h_ok)


def write_outputs_triton(
    num_accepted: Tensor, bonus: Tensor, path: Tensor, has_child: Tensor, rank: Tensor,
    on_path: Tensor, tokens: Tensor, hidden: Tensor,
    packed: Tensor, next_rows: Tensor, path_out: Tensor, keep_out: Tensor,
) -> bool:
    """As ``GraphedTreeStep._write_outputs_torch``: the packed results [B, 2 + 3P] (accepted
    count, bonus, the path's tokens, has-children, sibling ranks), module 1's next rows
    [B, P, H] (``hidden`` [B, N+1, H] at the path's nodes), and the rollback's path and kept
    depths. One launch; returns True (``run_kernel``)."""
    B, P = path.shape
    nodes, H = hidden.shape[1], hidden.shape[2]
    args = (num_accepted, bonus, path, has_child, rank, on_path, tokens, hidden)
    assert all(t.is_contiguous() for t in args) and next_rows.is_contiguous() and packed.is_contiguous()
    assert path_out.is_contiguous() and keep_out.is_contiguous() and tokens.shape == (B, nodes)
    _write_outputs_kernel[(B,)](
        *args, packed, next_rows, path_out, keep_out, nodes, H, packed.shape[1],
        P=P, BLOCK_P=triton.next_power_of_2(P), BLOCK_H=min(1024, triton.next_power_of_2(H)),
    )  # fmt: skip
    return True
