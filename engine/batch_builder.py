"""Turn per-sequence row lists into one flattened forward: ids, AttentionBatch, hidden inputs.

Every forward (prefill chunk, decode, MTP catch-up + draft rows, tree verification) is described
per sequence by a ``SeqRows``; this is the one place that lays them out for the attention
contract of docs/internals.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.host_tensor import int_table, int_tensor, to_device
from engine.model.attention_batch import AttentionBatch


@dataclass
class SeqRows:
    block_ids: list[int]
    ctx_len: int  # committed entries in the layer(s) this forward touches
    token_ids: list[int]  # [n] input token of each new row (written at slots ctx_len + j)
    positions: list[int]  # [n] RoPE position of each row
    mask: torch.Tensor  # [n, n] bool among the new rows
    query_ctx_lens: list[int] | None = None  # [n] committed entries each row sees (None: all)
    prev_hidden: torch.Tensor | None = None  # [n, H] MTP rows: depth-(d-1) hidden of each row


_ONE = torch.ones(1, 1, dtype=torch.bool)  # the mask of a one-row sequence (shared, read-only)


def causal_mask(n: int) -> torch.Tensor:
    return _ONE if n == 1 else torch.ones(n, n, dtype=torch.bool).tril()


def build_batch(
    rows: list[SeqRows], block_size: int, device: torch.device
) -> tuple[torch.Tensor, AttentionBatch]:
    """-> (input ids [N], AttentionBatch)."""
    counts = [len(r.token_ids) for r in rows]
    total = sum(counts)
    width = max(counts) if counts else 0
    max_blocks = max(max((len(r.block_ids) for r in rows), default=0), 1)
    # Host tensors built from whole flat lists, packed in C (``int_tensor``): a decode step of
    # 256 sequences is host work on the critical path of every autoregressive step.
    new_mask = torch.zeros(total, max(width, 1), dtype=torch.bool)
    offsets = [0, *itertools.accumulate(counts)]
    # A one-row sequence (a decode step) sees itself: its 1 x 1 mask is set for all in one go.
    new_mask[[offsets[i] for i, n in enumerate(counts) if n == 1], 0] = True
    for r, n, offset in zip(rows, counts, offsets, strict=False):
        if n > 1:
            new_mask[offset : offset + n, :n] = r.mask
    slots: list[int] = []
    query_ctx: list[int] = []
    any_limit = False
    for r, n in zip(rows, counts, strict=True):
        ctx, blocks = r.ctx_len, r.block_ids
        if ctx + n > len(blocks) * block_size:
            raise AssertionError("slot beyond the sequence's allocated blocks")
        if n == 1:
            slots.append(blocks[ctx // block_size] * block_size + ctx % block_size)
        else:
            slots.extend(blocks[pos // block_size] * block_size + pos % block_size
                         for pos in range(ctx, ctx + n))  # fmt: skip
        if r.query_ctx_lens is not None:
            any_limit = True
            query_ctx.extend(r.query_ctx_lens)
        else:
            query_ctx.extend([ctx] * n)
    starts = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = AttentionBatch(
        positions=to_device(int_tensor([p for r in rows for p in r.positions]), device),
        slot_mapping=to_device(int_tensor(slots), device),
        block_tables=to_device(int_table([r.block_ids for r in rows], max_blocks, -1), device),
        ctx_lens=to_device(int_tensor([r.ctx_len for r in rows], torch.int32), device),
        query_start=to_device(starts, device),
        new_mask=to_device(new_mask, device),
        query_ctx_lens=to_device(int_tensor(query_ctx, torch.int32), device) if any_limit else None,
    )
    ids = to_device(int_tensor([t for r in rows for t in r.token_ids]), device)
    return ids, batch
