"""The paged latent KV pool: fixed-size blocks shared by every layer, with an owner per block.

One tensor ``kv_cache [layers_total, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
holds the latent cache of every main and MTP layer; a block id covers the same token range in
every layer. The allocator records which sequence (and session, tenant) holds each block. A
block is zeroed — in every layer — the moment it is freed, so no block is ever handed out with
another sequence's data in it, and the count of zeroed bytes is kept for metrics and audit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.host_tensor import int_tensor, to_device


class KVCacheFull(ValueError):
    """Not enough free KV blocks (a request that can never fit gets this as a ValueError)."""


@dataclass(frozen=True)
class BlockOwner:
    sequence_id: str
    tenant: str = ""
    session_id: str | None = None


class BlockPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        latent_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV memory budget is too small for a single block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [layers, blocks, block_size, latent]
        self.kv_cache = torch.zeros(
            num_layers, num_blocks, block_size, latent_dim, dtype=dtype, device=device
        )
        self.bytes_per_block = num_layers * block_size * latent_dim * self.kv_cache.element_size()
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, BlockOwner] = {}
        self.zeroed_bytes_total = 0

    @staticmethod
    def blocks_for_budget(
        memory_bytes: int, num_layers: int, block_size: int, latent_dim: int, dtype: torch.dtype
    ) -> int:
        per_block = num_layers * block_size * latent_dim * torch.empty((), dtype=dtype).element_size()
        return memory_bytes // per_block

    # ---- accounting ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def owner_of(self, block_id: int) -> BlockOwner | None:
        return self._owner.get(block_id)

    # ---- allocation ----
    def allocate(self, count: int, owner: BlockOwner) -> list[int]:
        if count > len(self._free):
            raise KVCacheFull(f"KV cache full: need {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._owner[block] = owner
        return blocks

    def free(self, blocks: list[int]) -> int:
        """Zero ``blocks`` in every layer, return them to the pool; returns bytes zeroed."""
        if not blocks:
            return 0
        for block in blocks:
            if block not in self._owner:
                raise AssertionError(f"double free of KV block {block}")
        index = to_device(int_tensor(blocks), self.kv_cache.device)
        self.kv_cache.index_fill_(1, index, 0)
        for block in blocks:
            del self._owner[block]
            self._free.append(block)
        zeroed = len(blocks) * self.bytes_per_block
        self.zeroed_bytes_total += zeroed
        return zeroed

    def zero_slots(self, slots: torch.Tensor, layers: slice | None = None) -> None:
        """Zero individual flat slots (rejected draft entries) in the given layers."""
        if slots.numel() == 0:
            return
        flat = self.kv_cache.view(self.kv_cache.shape[0], -1, self.kv_cache.shape[-1])
        target = flat if layers is None else flat[layers]
        target.index_fill_(1, slots.to(self.kv_cache.device, torch.long), 0)
