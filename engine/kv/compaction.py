"""Commit a verify step's KV: move the accepted path's entries down, zero the rejected slots.

After a verify step, accepted node ``a_i`` of a sequence sits at flat slot ``ctx + node_index``
and must end at ``ctx + i`` (docs/internals.md), in every layer of the cache
``kv_cache_all [L, num_blocks, block_size, D]`` (flat slot ``block_id * block_size + offset``).
The tree's other slots held rejected drafts and are zeroed (no remanence).

``compact_and_zero(kv_cache_all, src_slots, dst_slots, zero_slots)``:
1. moves, in order ``k = 0, 1, ...``: slot ``dst_slots[k]`` of every layer takes the current
   content of slot ``src_slots[k]``, with ``dst <= src``. "In order" matters for chains such as
   ``src=[5, 7], dst=[4, 5]``: slot 5 is read by the first move before the second overwrites it;
2. then zeroes ``zero_slots`` in every layer (they never include a ``dst`` slot; they may
   include ``src`` slots that were moved away from).
Moves of several sequences can be concatenated into one call: their slots are disjoint.
``dst_slots`` must be distinct. ``compact_and_zero`` runs the fused Triton kernel
(``engine/kernels/compaction.py``, one launch) on CUDA when Triton is installed, this module's
PyTorch reference otherwise.

``commit_tree_kv(kv_cache_all, num_layers, tree_slots, path, keep)`` is the same commit in the
layout of the graphed tree step (every sequence's tree at once, padded to one shape): tree node
``i`` of sequence ``b`` sits at ``tree_slots[b, i]``; depth ``j``'s slot takes node
``path[b, j]``'s entry where ``keep[b, j]``, every other tree slot is zeroed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import run_kernel, triton_available


def compact_and_zero(
    kv_cache_all: Tensor,  # [L, num_blocks, block_size, D] contiguous
    src_slots: Tensor,  # [K] int64
    dst_slots: Tensor,  # [K] int64
    zero_slots: Tensor,  # [Z] int64
) -> None:
    """Move accepted entries ``src -> dst`` in order, then zero ``zero_slots`` (all layers)."""
    if kv_cache_all.is_cuda and triton_available():
        from engine.kernels.compaction import compact_and_zero_triton

        compact_and_zero_triton(kv_cache_all, src_slots, dst_slots, zero_slots)
    else:
        compact_and_zero_reference(kv_cache_all, src_slots, dst_slots, zero_slots)


def compact_and_zero_reference(
    kv_cache_all: Tensor,  # [L, num_blocks, block_size, D] contiguous
    src_slots: Tensor,  # [K] int64
    dst_slots: Tensor,  # [K] int64
    zero_slots: Tensor,  # [Z] int64
) -> None:
    """PyTorch version of ``compact_and_zero`` (the CPU path)."""
    num_layers, entry_dim = kv_cache_all.shape[0], kv_cache_all.shape[-1]
    flat = kv_cache_all.view(num_layers, -1, entry_dim)  # [L, num_slots, D]
    src, dst = src_slots.long(), dst_slots.long()  # [K], [K]
    if src.numel() > 0:
        # A gather-then-scatter equals the in-order moves unless a move reads a slot that an
        # earlier move wrote (dst[j] == src[k] for some j < k): then replay the moves one by one.
        reads_earlier_write = torch.triu(dst[:, None] == src[None, :], diagonal=1)  # [K, K]
        if bool(reads_earlier_write.any()):
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                flat[:, d] = flat[:, s]
        else:
            flat.index_copy_(1, dst, flat.index_select(1, src))
    if zero_slots.numel() > 0:
        flat.index_fill_(1, zero_slots.long(), 0)


def commit_tree_kv(
    kv_cache_all: Tensor,  # [L_all, num_blocks, block_size, D] contiguous
    num_layers: int,
    tree_slots: Tensor,  # [B, T] int64: node i of sequence b at flat slot tree_slots[b, i]
    path: Tensor,  # [B, P] int64: the accepted path's node indices, root first (P <= T)
    keep: Tensor,  # [B, P] bool: depth j was accepted
) -> None:
    """Commit every verified tree in layers ``:num_layers``: slot ``tree_slots[b, j]`` takes the
    entry of node ``path[b, j]`` where ``keep[b, j]``, every other tree slot is zeroed. Each
    sequence's reads happen before its writes (a kept node may sit where an earlier depth goes);
    the sequences' trees must be disjoint. One Triton launch on CUDA, PyTorch ops otherwise."""
    if kv_cache_all.is_cuda and triton_available():
        from engine.kernels.tree_commit import commit_tree_kv_triton

        def launch() -> bool:
            commit_tree_kv_triton(kv_cache_all, num_layers, tree_slots, path, keep)
            return True

        if run_kernel("tree_commit", launch):
            return
    commit_tree_kv_reference(kv_cache_all, num_layers, tree_slots, path, keep)


def commit_tree_kv_reference(
    kv_cache_all: Tensor,  # [L_all, num_blocks, block_size, D] contiguous
    num_layers: int,
    tree_slots: Tensor,  # [B, T] int64
    path: Tensor,  # [B, P] int64
    keep: Tensor,  # [B, P] bool
) -> None:
    """PyTorch version of ``commit_tree_kv`` (the CPU path, the kernel's reference)."""
    main = kv_cache_all[:num_layers]
    flat = main.view(num_layers, -1, main.shape[-1])  # [L, num_slots, D]
    P = path.shape[1]
    src = tree_slots.gather(1, path).reshape(-1)  # [B*P] the accepted entries' slots
    moved = flat.index_select(1, src)  # [L, B*P, D], read before any write
    moved = torch.where(keep.reshape(1, -1, 1), moved, 0)  # off-path depths: zeros
    flat.index_copy_(1, tree_slots[:, :P].reshape(-1), moved)
    flat.index_fill_(1, tree_slots[:, P:].reshape(-1), 0)  # rejected drafts
