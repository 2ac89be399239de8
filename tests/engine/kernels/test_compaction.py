"""Committing a verify step's KV: accepted entries moved in order, rejected slots zeroed."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv.compaction import compact_and_zero, compact_and_zero_reference

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, DIM = 3, 6, 4, 10


def _cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, DIM)  # [L, num_blocks, block_size, D]
    return torch.randn(shape, generator=gen).to(dtype)


def _slot_bytes(cache: torch.Tensor, slot: int) -> list[bytes]:
    """Raw bytes of one flat slot in every layer, read from the tensor's storage."""
    raw = bytes(cache.untyped_storage())
    entry = DIM * cache.element_size()
    layer = NUM_BLOCKS * BLOCK_SIZE * entry
    starts = [i * layer + slot * entry for i in range(NUM_LAYERS)]
    return [raw[s: s + entry] for s in starts]


def _replay(cache: torch.Tensor, src: list[int], dst: list[int], zero: list[int]) -> torch.Tensor:
    out = cache.clone()
    flat = out.view(NUM_LAYERS, -1, DIM)  # [L, slots, D]
    for s, d in zip(src, dst, strict=True):
        flat[:, d] = flat[:, s]
    flat[:, zero] = 0
    return out


def _run(cache: torch.Tensor, src: list[int], dst: list[int], zero: list[int]) -> None:
    as_long = [torch.tensor(x, dtype=torch.int64) for x in (src, dst, zero)]
    compact_and_zero(cache, *as_long)


def test_overlapping_chain_moves_in_order_and_zeroes_rejected() -> None:
    cache = _cache()
    before = {s: _slot_bytes(cache, s) for s in range(12)}
    _run(cache, src=[5, 7], dst=[4, 5], zero=[6, 7, 9])
    assert _slot_bytes(cache, 4) == before[5]  # read before the second move overwrote it
    assert _slot_bytes(cache, 5) == before[7]
    for s in (6, 7, 9):
        assert _slot_bytes(cache, s) == [bytes(DIM * 4)] * NUM_LAYERS
    for s in (0, 1, 2, 3, 8, 10, 11):
        assert _slot_bytes(cache, s) == before[s]


def test_move_reading_an_earlier_destination_sees_the_new_value() -> None:
    cache = _cache()
    want = _replay(cache, [7, 5], [5, 4], [8])
    _run(cache, [7, 5], [5, 4], [8])
    assert torch.equal(cache, want)
    original = _cache().view(NUM_LAYERS, -1, DIM)  # [L, slots, D]
    assert torch.equal(cache.view(NUM_LAYERS, -1, DIM)[:, 4], original[:, 7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_sequences_match_in_order_replay(dtype: torch.dtype) -> None:
    rng = random.Random(1)
    src, dst, zero = [], [], []
    for ctx in (0, 8, 16):  # three sequences, tree of 7 nodes each, path of 3 accepted drafts
        path = sorted(rng.sample(range(1, 7), 3))
        src += [ctx + i for i in path]
        dst += [ctx + 1 + k for k in range(3)]
        zero += [ctx + i for i in range(1, 7) if ctx + i not in dst[-3:]]
    cache = _cache(dtype)
    want = _replay(cache, src, dst, zero)
    _run(cache, src, dst, zero)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))  # bit-exact


def test_empty_moves_and_zeroes_are_no_ops() -> None:
    cache = _cache()
    before = cache.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    compact_and_zero_reference(cache, empty, empty, empty)
    assert torch.equal(cache, before)


def test_tree_commit_reference_equals_the_per_sequence_replay() -> None:
    from tests.engine.kernels.commit_cases import check_tree_commit

    bad, _ = check_tree_commit("cpu", triton=False)
    assert bad == 0, "commit_tree_kv_reference differs from the naive replay"


def test_tree_commit_reads_every_kept_entry_before_writing() -> None:
    from engine.kv.compaction import commit_tree_kv
    from tests.engine.kernels.commit_cases import naive_commit

    cache = _cache()
    slots = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])  # [1, T]: node i at slot 3 + i
    path = torch.tensor([[0, 2, 3, 6]])  # depth 1 reads node 2, which depth 2 overwrites
    keep = torch.ones(1, 4, dtype=torch.bool)
    before = {s: _slot_bytes(cache, s) for s in range(12)}
    want = naive_commit(cache, NUM_LAYERS, slots, path, keep)
    commit_tree_kv(cache, NUM_LAYERS, slots, path, keep)
    assert torch.equal(cache, want)
    assert [_slot_bytes(cache, s) for s in (3, 4, 5, 6)] == [before[s] for s in (3, 5, 6, 9)]
    for s in (7, 8, 9):  # rejected drafts
        assert _slot_bytes(cache, s) == [bytes(DIM * 4)] * NUM_LAYERS
    for s in (0, 1, 2, 10, 11):
        assert _slot_bytes(cache, s) == before[s]


def test_tree_commit_zeroes_depths_past_the_accepted_path_and_only_given_layers() -> None:
    from engine.kv.compaction import commit_tree_kv

    cache = _cache()
    original = cache.clone().view(NUM_LAYERS, -1, DIM)  # [L, slots, D]
    slots = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11]])  # [2, T]
    path = torch.tensor([[0, 2, 2], [0, 0, 0]])  # one accepted draft; none
    keep = torch.tensor([[True, True, False], [True, False, False]])
    commit_tree_kv(cache, 2, slots, path, keep)  # the last layer is not the target's
    flat = cache.view(NUM_LAYERS, -1, DIM)
    assert torch.equal(flat[:2, 0], original[:2, 0]) and torch.equal(flat[:2, 1], original[:2, 2])
    assert torch.equal(flat[:2, 8], original[:2, 8])
    assert not flat[:2, [2, 3, 9, 10, 11]].any()
    assert torch.equal(flat[2], original[2])
