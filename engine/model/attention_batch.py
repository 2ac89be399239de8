"""AttentionBatch: where a forward's new tokens go in the paged cache and what each one sees.

Built once per forward by the engine (see docs/internals.md) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionBatch:
    positions: torch.Tensor  # [N] int64 RoPE position of each new token
    slot_mapping: torch.Tensor  # [N] int64 flat cache slot (block * block_size + offset) to write
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    ctx_lens: torch.Tensor  # [B] int32 committed entries before the new tokens of sequence b
    query_start: torch.Tensor  # [B + 1] int32 offsets of each sequence's new tokens
    new_mask: torch.Tensor  # [N, M] bool: query n sees new token j of its own sequence
    # [N] int32 committed entries visible to each query (<= its sequence's ctx_len); None = all.
    # MTP modules beyond the second hide the most recent committed entries (see engine/spec/drafter.py).
    query_ctx_lens: torch.Tensor | None = None
    # Work derived from the fields above once per forward and shared by its layers (the
    # reference attention's plan); build a new batch, not new field values, for another forward.
    memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
