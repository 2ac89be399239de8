"""Fused Triton kernel for ``engine.kv.compaction.commit_tree_kv``: a verified tree's KV commit.

Grid ``(B, L, cdiv(D, BLOCK_D))``: program ``(b, layer, chunk)`` owns columns
``chunk * BLOCK_D : (chunk + 1) * BLOCK_D`` of sequence ``b``'s tree slots in one layer. It loads
the entries of the accepted path (node ``path[j]``'s slot for each kept depth ``j``), waits for
every thread of the block (``bar.sync``: all of the tree's reads happen before any write), then
writes the whole tree: depth ``j``'s slot takes the ``j``-th accepted entry, every other slot
(off-path depths, rejected drafts) zeros. A sequence's reads and writes stay in its programs and
the sequences' trees are disjoint, so no ordering is needed between programs.

The PyTorch version (the CPU path) takes four kernels and two temporaries the size of the moved
entries (gather, mask, scatter, fill); this is one launch that reads each kept entry once and
writes each tree slot once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _commit_tree_kv_kernel(
    kv_ptr, slots_ptr, path_ptr, keep_ptr,
    T, P, stride_layer, D,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = offs_d < D
    node = tl.arange(0, BLOCK_T)  # [BLOCK_T] tree node / path depth
    in_tree = node < T
    on_path = node < P
    dst = tl.load(slots_ptr + seq * T + node, mask=in_tree, other=0)  # [BLOCK_T] int64 slots
    hop = tl.load(path_ptr + seq * P + node, mask=on_path, other=0)  # [BLOCK_T] node index
    kept = tl.load(keep_ptr + seq * P + node, mask=on_path, other=0) != 0  # [BLOCK_T]
    src = tl.load(slots_ptr + seq * T + hop, mask=kept, other=0)  # [BLOCK_T] int64 slots
    base = kv_ptr + layer * stride_layer
    rows = tl.load(base + src[:, None] * D + offs_d[None, :],
                   mask=kept[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_D]
    tl.debug_barrier()  # the tree's reads before its writes (a kept source may be rewritten)
    tl.store(base + dst[:, None] * D + offs_d[None, :], rows, mask=in_tree[:, None] & d_ok[None, :])


def commit_tree_kv_triton(
    kv_cache_all: Tensor,  # [L_all, num_blocks, block_size, D] contiguous
    num_layers: int,
    tree_slots: Tensor,  # [B, T] int64 contiguous
    path: Tensor,  # [B, P] int64 contiguous
    keep: Tensor,  # [B, P] bool contiguous
    *,
    block_d: int = 32,
) -> None:
    """Triton version of ``engine.kv.compaction.commit_tree_kv`` (same semantics)."""
    assert kv_cache_all.is_contiguous() and tree_slots.is_contiguous()
    assert path.is_contiguous() and keep.is_contiguous() and path.shape == keep.shape
    B, T = tree_slots.shape
    P = path.shape[1]
    assert path.shape[0] == B and P <= T
    if B == 0 or num_layers == 0:
        return
    entry_dim = kv_cache_all.shape[-1]
    grid = (B, num_layers, triton.cdiv(entry_dim, block_d))
    _commit_tree_kv_kernel[grid](
        kv_cache_all, tree_slots, path, keep, T, P, kv_cache_all.stride(0), entry_dim,
        BLOCK_T=triton.next_power_of_2(T), BLOCK_D=block_d, num_warps=2,
    )
