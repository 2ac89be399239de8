"""The PyTorch paged MLA attention (the engine's CPU path) against a naive per-query loop."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import engine.attention.reference as reference
from engine.attention import paged_mla_attention, slot_mapping_for, write_kv
from tests.engine.kernels.cases import make_case, naive_attention


@pytest.mark.parametrize(
    ("seed", "ctx_lens", "new_counts", "mask_kind", "block_size"),
    [
        (0, [0, 5, 17, 9], [3, 1, 6, 4], "tree", 4),  # verify: random trees, ragged contexts
        (1, [40, 2], [12, 16], "tree", 8),
        (2, [0, 0], [7, 3], "causal", 4),  # prefill from empty
        (3, [11, 30], [9, 5], "causal", 16),  # chunked prefill after a committed prefix
        (4, [1, 13, 40, 64], [1, 1, 1, 1], "causal", 4),  # autoregressive decode
    ],
)
def test_reference_matches_naive(
    seed: int, ctx_lens: list[int], new_counts: list[int], mask_kind: str, block_size: int
) -> None:
    case = make_case(seed, ctx_lens, new_counts, mask_kind=mask_kind, block_size=block_size)
    out = reference.paged_mla_attention(*case.args())  # [N, H, R]
    assert out.shape == case.q_latent.shape and out.dtype == torch.float32
    assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_query_ctx_lens_hide_recent_committed_keys() -> None:
    case = make_case(5, [7, 12], [4, 3], with_query_ctx=True)
    out = paged_mla_attention(*case.args(), query_ctx_lens=case.query_ctx_lens)
    assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)
    full = paged_mla_attention(*case.args())
    assert not torch.allclose(out, full)  # the limit really changes what is seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_return_their_dtype(dtype: torch.dtype) -> None:
    case = make_case(6, [3, 21], [5, 7], dtype=dtype, rank=32)
    out = paged_mla_attention(*case.args())
    assert out.dtype == dtype
    # naive_attention upcasts the same rounded inputs: only output rounding differs.
    assert_close(out.double(), naive_attention(case), atol=1e-2, rtol=1e-2)


def test_grouping_under_a_tiny_score_budget_gives_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = make_case(7, [0, 9, 30, 4], [6, 2, 5, 1])
    whole = paged_mla_attention(*case.args())
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 1)  # one sequence per group
    assert_close(paged_mla_attention(*case.args()), whole, atol=1e-6, rtol=1e-6)


def test_query_that_sees_nothing_gets_zeros() -> None:
    case = make_case(8, [0, 4], [2, 2])
    case.new_mask[0] = False  # first token of a sequence with no committed context
    out = paged_mla_attention(*case.args())
    assert torch.count_nonzero(out[0]) == 0 and torch.isfinite(out).all()
    assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_write_kv_stores_entries_at_their_block_table_slots() -> None:
    block_size, dim = 4, 6
    cache = torch.zeros(5, block_size, dim)  # [num_blocks, block_size, D]
    tables = torch.tensor([[3, 0, -1], [1, 4, 2]], dtype=torch.int32)  # [B, max_blocks]
    seq = torch.tensor([0, 0, 1, 1, 1])  # [N]
    pos = torch.tensor([3, 4, 0, 7, 9])  # [N]
    slots = slot_mapping_for(tables, seq, pos, block_size)  # [N]
    assert slots.tolist() == [3 * 4 + 3, 0 * 4 + 0, 1 * 4 + 0, 4 * 4 + 3, 2 * 4 + 1]
    entries = torch.arange(5 * dim, dtype=torch.float32).view(5, dim)  # [N, D]
    write_kv(cache, slots, entries.to(torch.float64))
    for i, (b, p) in enumerate(zip(seq.tolist(), pos.tolist(), strict=True)):
        assert torch.equal(cache[tables[b, p // block_size], p % block_size], entries[i])
    assert torch.count_nonzero(cache) == entries.count_nonzero()  # nothing else written
