"""Fused Triton kernel for ``engine.kv.compaction.compact_and_zero`` (one launch, all layers).

Grid ``(L, cdiv(D, BLOCK_D))``: program ``(layer, chunk)`` owns columns
``chunk * BLOCK_D : (chunk + 1) * BLOCK_D`` of every slot of one layer. Every read and write of
those elements happens in that one program, in program order: first the moves ``k = 0, 1, ...``
(each a ``BLOCK_D`` row load then store, separated by a barrier so a later move reads what an
earlier one wrote, as in overlapping chains), then the zeroing in ``[BLOCK_Z, BLOCK_D]`` tiles.
No two programs touch the same element, so no inter-program ordering is needed.
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
    BLOCK_D: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = offs_d < D
    base = kv_ptr + layer * stride_layer
    for k in range(0, num_moves):
        src = tl.load(src_ptr + k)  # int64 flat slot
        dst = tl.load(dst_ptr + k)
        row = tl.load(base + src * D + offs_d, mask=d_ok)  # [BLOCK_D]
        tl.store(base + dst * D + offs_d, row, mask=d_ok)
        tl.debug_barrier()
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
        BLOCK_D=block_d, BLOCK_Z=block_z, num_warps=2,
    )
