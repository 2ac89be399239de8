"""KV block pool: allocation, ownership, zero-on-free (read back from raw memory), accounting."""

from __future__ import annotations

import pytest
import torch

from engine.kv.block_pool import BlockOwner, BlockPool, KVCacheFull


def _pool(blocks: int = 4) -> BlockPool:
    return BlockPool(num_layers=3, num_blocks=blocks, block_size=4, latent_dim=5,
                     dtype=torch.float32, device="cpu")


def test_allocate_records_owner_and_counts() -> None:
    pool = _pool()
    a = pool.allocate(2, BlockOwner("seq-a", tenant="t1", session_id="s1"))
    assert len(set(a)) == 2 and pool.num_used == 2 and pool.num_free == 2
    assert pool.owner_of(a[0]) == BlockOwner("seq-a", "t1", "s1")
    with pytest.raises(KVCacheFull, match="need 3 blocks, 2 free"):
        pool.allocate(3, BlockOwner("seq-b"))
    assert pool.num_free == 2, "a failed allocation takes nothing"


def test_free_zeroes_every_layer_before_reuse() -> None:
    pool = _pool()
    blocks = pool.allocate(4, BlockOwner("tenant-a-secret"))
    pool.kv_cache.fill_(7.0)
    zeroed = pool.free(blocks[:2])
    assert zeroed == 2 * pool.bytes_per_block == 2 * 3 * 4 * 5 * 4
    raw = pool.kv_cache[:, blocks[:2]]
    assert torch.count_nonzero(raw) == 0
    assert torch.all(pool.kv_cache[:, blocks[2:]] == 7.0), "other blocks untouched"
    again = pool.allocate(2, BlockOwner("tenant-b"))
    assert set(again) == set(blocks[:2])
    assert torch.count_nonzero(pool.kv_cache[:, again]) == 0
    assert pool.owner_of(again[0]) == BlockOwner("tenant-b")
    assert pool.zeroed_bytes_total == zeroed


def test_double_free_is_an_internal_error() -> None:
    pool = _pool()
    blocks = pool.allocate(1, BlockOwner("x"))
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_zero_slots_clears_single_entries() -> None:
    pool = _pool()
    pool.allocate(4, BlockOwner("x"))
    pool.kv_cache.fill_(1.0)
    pool.zero_slots(torch.tensor([5, 6]), slice(0, 2))
    flat = pool.kv_cache.view(3, -1, 5)
    assert torch.count_nonzero(flat[:2, 5:7]) == 0
    assert torch.all(flat[2, 5:7] == 1.0) and torch.all(flat[:2, 4] == 1.0)


def test_budget_sizing() -> None:
    per_block = 3 * 4 * 5 * 4
    assert BlockPool.blocks_for_budget(10 * per_block + 1, 3, 4, 5, torch.float32) == 10
