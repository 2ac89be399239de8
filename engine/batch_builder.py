"""Turn per-sequence row lists into one flattened forward: ids, AttentionBatch, hidden inputs.

Every forward (prefill chunk, decode, MTP catch-up + draft rows, tree verification) is described
per sequence by a ``SeqRows``; this is the one place that lays them out for the attention
contract of docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def build_batch(
    rows: list[SeqRows], block_size: int, device: torch.device
) -> tuple[torch.Tensor, AttentionBatch]:
    """-> (input ids [N], AttentionBatch)."""
    counts = [len(r.token_ids) for r in rows]
    total = sum(counts)
    width = max(counts) if counts else 0
    max_blocks = max((len(r.block_ids) for r in rows), default=0)
    tables = torch.full((len(rows), max(max_blocks, 1)), -1, dtype=torch.int32)
    new_mask = torch.zeros(total, max(width, 1), dtype=torch.bool)
    slots: list[int] = []
    query_ctx: list[int] = []
    any_limit = False
    offset = 0
    for b, r in enumerate(rows):
        n = counts[b]
        tables[b, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        new_mask[offset : offset + n, :n] = r.mask
        for j in range(n):
            pos = r.ctx_len + j
            block_index = pos // block_size
            if block_index >= len(r.block_ids):
                raise AssertionError("slot beyond the sequence's allocated blocks")
            slots.append(r.block_ids[block_index] * block_size + pos % block_size)
        if r.query_ctx_lens is not None:
            any_limit = True
            query_ctx.extend(r.query_ctx_lens)
        else:
            query_ctx.extend([r.ctx_len] * n)
        offset += n
    starts = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = AttentionBatch(
        positions=torch.tensor([p for r in rows for p in r.positions], dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=tables.to(device),
        ctx_lens=torch.tensor([r.ctx_len for r in rows], dtype=torch.int32, device=device),
        query_start=starts.to(device),
        new_mask=new_mask.to(device),
        query_ctx_lens=torch.tensor(query_ctx, dtype=torch.int32, device=device) if any_limit else None,
    )
    ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long, device=device)
    return ids, batch
