"""Fused Triton kernel for ``engine.kv.compaction.compact_and_zero`` (one launch, all layers).

Grid ``(L, cdiv(D, BLOCK_D))``: program ``(layer, chunk)`` owns columns
``chunk * BLOCK_D : (chunk + 1) * BLOCK_D`` of every slot of one layer, so every read and write
of an element happens in one program and only ordering inside a program matters:

- moves, in tiles of ``BLOCK_K`` processed in order with a barrier between tiles. A tile where
  no move reads a slot written by an earlier move of the same tile (the usual case: accepted
  paths move down to fresh slots) loads all its rows, synchronises, then stores them -- the
  same result as moving one by one. A tile with such a clash (e.g. ``src=[7, 5], dst=[5, 4]``)
  replays its moves one by one, a barrier after each;
- then the zeroing, in ``[BLOCK_Z, BLOCK_D]`` tiles (zero slots may include moved-from slots,
  never a destination).
A barrier (``bar.sync``) orders all earlier global reads and writes of the block before later
ones, which is what makes a later move see an earlier one's write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _compact_and_zero_kernel(
    kv_ptr, src_ptr, dst_ptr, zero_ptr,
    num_moves, num_zero, stride_layer, D,
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = offs_d < D
    base = kv_ptr + layer * stride_layer
    order = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    for k0 in range(0, num_moves, BLOCK_K):
        offs_k = k0 + order  # [BLOCK_K]
        k_ok = offs_k < num_moves
        src = tl.load(src_ptr + offs_k, mask=k_ok, other=0)  # [BLOCK_K] int64 flat slots
        dst = tl.load(dst_ptr + offs_k, mask=k_ok, other=-1)  # [BLOCK_K]
        # Does a move of this tile read a slot that an earlier move of the tile writes?
        clash = (dst[:, None] == src[None, :]) & (order[:, None] < order[None, :])
        clash = clash & k_ok[:, None] & k_ok[None, :]  # [BLOCK_K, BLOCK_K]
        hazard = tl.max(tl.max(clash.to(tl.int32), axis=1), axis=0)
        if hazard == 0:
            # All reads, barrier, all writes: equal to the in-order moves without such a clash.
            tile_ok = k_ok[:, None] & d_ok[None, :]
            rows = tl.load(base + src[:, None] * D + offs_d[None, :], mask=tile_ok)
            tl.debug_barrier()
            tl.store(base + dst[:, None] * D + offs_d[None, :], rows, mask=tile_ok)
        else:
            for k in range(k0, tl.minimum(k0 + BLOCK_K, num_moves)):
                s = tl.load(src_ptr + k)
                d = tl.load(dst_ptr + k)
                row = tl.load(base + s * D + offs_d, mask=d_ok)  # [BLOCK_D]
                tl.store(base + d * D + offs_d, row, mask=d_ok)
                tl.debug_barrier()
        tl.debug_barrier()  # the next tile reads what this one wrote
    for z0 in range(0, num_zero, BLOCK_Z):
        offs_z = z0 + tl.arange(0, BLOCK_Z)  # [BLOCK_Z]
        z_ok = offs_z < num_zero
        slots = tl.load(zero_ptr + offs_z, mask=z_ok, other=0)  # [BLOCK_Z] int64
        zeros = tl.zeros([BLOCK_Z, BLOCK_D], dtype=kv_ptr.dtype.element_ty)
        tl.store(base + slots[:, None] * D + offs_d[None, :], zeros,
                 mask=z_ok[:, None] & d_ok[None, :])


def compact_and_zero_triton(
    kv_cache_all: Tensor,  # [L, num_blocks, block_size, D] contiguous
    src_slots: Tensor,  # [K] int64
    dst_slots: Tensor,  # [K] int64
    zero_slots: Tensor,  # [Z] int64
    *,
    block_d: int = 64,
    block_k: int = 32,
    block_z: int = 32,
) -> None:
    """Triton version of ``engine.kv.compaction.compact_and_zero`` (same semantics)."""
    assert kv_cache_all.is_contiguous()
    num_moves, num_zero = src_slots.numel(), zero_slots.numel()
    assert dst_slots.numel() == num_moves
    if num_moves == 0 and num_zero == 0:
        return
    num_layers, entry_dim = kv_cache_all.shape[0], kv_cache_all.shape[-1]
    device = kv_cache_all.device
    src = src_slots.to(device=device, dtype=torch.int64).contiguous()  # [K]
    dst = dst_slots.to(device=device, dtype=torch.int64).contiguous()  # [K]
    zero = zero_slots.to(device=device, dtype=torch.int64).contiguous()  # [Z]
    # Empty index tensors are never read; give the kernel a real buffer anyway.
    placeholder = src if num_moves > 0 else zero
    src, dst = (src, dst) if num_moves > 0 else (placeholder, placeholder)
    zero = zero if num_zero > 0 else placeholder
    grid = (num_layers, triton.cdiv(entry_dim, block_d))
    _compact_and_zero_kernel[grid](
        kv_cache_all, src, dst, zero, num_moves, num_zero, kv_cache_all.stride(0), entry_dim,
        BLOCK_D=block_d, BLOCK_K=block_k, BLOCK_Z=block_z, num_warps=4,
    )
