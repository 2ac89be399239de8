"""PyTorch paged absorbed-MLA attention: the engine's CPU path and the kernels' reference.

Layout (docs/internals.md): one layer's cache is ``kv_cache [num_blocks, block_size, R + P]``,
each entry ``[c_kv (R) | k_rope (P)]``; flat slot ``block_id * block_size + offset``. Sequence
``b`` owns the new tokens ``query_start[b] : query_start[b + 1]`` of the flattened batch; its
key at position ``pos`` lives in block ``block_tables[b, pos // block_size]``. Positions
``0 .. ctx_b - 1`` are committed (visible to every query of ``b``, or to the first
``query_ctx_lens[n]`` of them when given); positions ``ctx_b + j`` hold the new tokens, visible
to query ``n`` where ``new_mask[n, j]``.

Absorbed MLA: the score of query ``n``, head ``h`` against a key is
``scale * (q_latent[n, h] . c_kv + q_rope[n, h] . k_rope)`` and the value is ``c_kv`` itself, so
the output stays in latent space ``[N, H, R]`` (the caller applies ``W_UV``). A query that sees
no key at all gets a zero row.

Sequences are processed in groups padded to the group's longest query list and key range; a
group is sized so that its float32 score tensor stays under ``_SCORE_BUDGET`` elements, so the
reference also runs at GPU batch sizes (the benchmark uses it there) without exhausting memory.

Everything but the queries and the cache is the same in every layer of a forward: the groups,
the key slots, the query rows and the visibility bias form an ``AttentionPlan``, built once per
forward (``attention_plan``; ``MultiHeadLatentAttention`` keeps it on the ``AttentionBatch``) so
that a layer only gathers, multiplies and scatters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_SCORE_BUDGET = 1 << 26  # elements of one group's [g, Q, H, S] float32 score tensor (256 MiB)


def write_kv(
    kv_cache: Tensor,  # [num_blocks, block_size, D] one layer's cache, contiguous
    slot_mapping: Tensor,  # [N] int64 flat slot of each entry
    entries: Tensor,  # [N, D] new latent entries [c_kv | k_rope]
) -> None:
    """Store ``entries[i]`` at flat slot ``slot_mapping[i]`` (cast to the cache dtype)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, D]
    flat.index_copy_(0, slot_mapping.long(), entries.to(kv_cache.dtype))


def slot_mapping_for(
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    seq_index: Tensor,  # [N] int64 sequence of each entry
    slot_pos: Tensor,  # [N] int64 position of each entry in its sequence
    block_size: int,
) -> Tensor:  # [N] int64 flat slots
    """Flat cache slot of position ``slot_pos[i]`` of sequence ``seq_index[i]``.

    The positions must be covered by allocated blocks (no -1 entry is looked up).
    """
    pos = slot_pos.long()  # [N]
    blocks = block_tables[seq_index.long(), pos // block_size].long()  # [N]
    return blocks * block_size + pos % block_size


@dataclass(frozen=True)
class _GroupPlan:
    """Layer-independent tensors of one group of ``g`` sequences (see ``_attend_group``)."""

    max_q: int
    slots: Tensor  # [g, S] int64 flat cache slot of each padded key position (0 when padding)
    qidx: Tensor  # [g, Q] int64 token of each padded query row (0 when padding)
    bias: Tensor  # [g, Q, 1, S] float32: 0 where the query sees the key, -inf elsewhere
    rows: Tensor | None  # [K] int64 padded rows (g * Q space) kept: real, seeing a key; None: all
    dst: Tensor | None  # [K] int64 their tokens; None when the group's rows are the tokens 0..N-1


@dataclass(frozen=True)
class AttentionPlan:
    """What ``paged_mla_attention`` computes from the batch alone, shared by every layer."""

    num_tokens: int
    num_heads: int
    block_size: int
    groups: tuple[_GroupPlan, ...]


def attention_plan(
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    ctx_lens: Tensor,  # [B] int32
    query_start: Tensor,  # [B + 1] int32
    new_mask: Tensor,  # [N, M] bool
    num_heads: int,
    block_size: int,
    query_ctx_lens: Tensor | None = None,  # [N] int32
) -> AttentionPlan:
    """Groups, key slots, query rows and visibility of a batch (one host read of its sizes)."""
    max_new = new_mask.shape[1]
    starts = query_start.long()  # [B + 1]
    num_new = starts[1:] - starts[:-1]  # [B]
    num_tokens = int(new_mask.shape[0])
    ctx = ctx_lens.long()  # [B]
    kv_lens = ctx + num_new  # [B]
    num_new_host = num_new.tolist()
    kv_lens_host = kv_lens.tolist()
    assert max(num_new_host, default=0) <= max_new, "new_mask narrower than a sequence's tokens"

    groups: list[_GroupPlan] = []
    b0 = 0
    num_seqs = len(num_new_host)
    while b0 < num_seqs:
        # Grow the group while its padded score tensor fits the budget.
        b1, g_q, g_s = b0 + 1, num_new_host[b0], kv_lens_host[b0]
        while b1 < num_seqs:
            q_next, s_next = max(g_q, num_new_host[b1]), max(g_s, kv_lens_host[b1])
            if (b1 + 1 - b0) * q_next * num_heads * s_next > _SCORE_BUDGET:
                break
            b1, g_q, g_s = b1 + 1, q_next, s_next
        if g_q > 0:
            groups.append(_plan_group(
                block_tables[b0:b1], ctx[b0:b1], starts[b0:b1], num_new[b0:b1], kv_lens[b0:b1],
                new_mask, query_ctx_lens, g_q, g_s, block_size, num_tokens,
            ))  # fmt: skip
        b0 = b1
    return AttentionPlan(num_tokens, num_heads, block_size, tuple(groups))


def paged_mla_attention(
    q_latent: Tensor,  # [N, H, R]
    q_rope: Tensor,  # [N, H, P]
    kv_cache: Tensor,  # [num_blocks, block_size, R + P]
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    ctx_lens: Tensor,  # [B] int32
    query_start: Tensor,  # [B + 1] int32
    new_mask: Tensor,  # [N, M] bool
    scale: float,
    query_ctx_lens: Tensor | None = None,  # [N] int32 committed keys query n sees (<= ctx_b)
    plan: AttentionPlan | None = None,  # this batch's ``attention_plan`` (built here if None)
) -> Tensor:  # [N, H, R] in q_latent's dtype
    """Attention of every new token over its sequence's committed and visible new keys."""
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    entry_dim = kv_cache.shape[-1]
    assert entry_dim == rank + rope_dim, (entry_dim, rank, rope_dim)
    if num_tokens == 0:
        return q_latent.new_zeros(num_tokens, num_heads, rank)
    block_size = kv_cache.shape[1]
    if plan is None:
        plan = attention_plan(
            block_tables, ctx_lens, query_start, new_mask, num_heads, block_size, query_ctx_lens
        )
    assert (plan.num_tokens, plan.num_heads, plan.block_size) == (num_tokens, num_heads, block_size)
    kv_flat = kv_cache.reshape(-1, entry_dim)  # [num_blocks * block_size, R + P]
    q_all = torch.cat([q_latent, q_rope], dim=-1)  # [N, H, R + P]
    if len(plan.groups) == 1 and plan.groups[0].dst is None:  # every token, in order
        return _attend_group(q_all, kv_flat, plan.groups[0], rank, scale).to(q_latent.dtype)
    out = q_latent.new_zeros(num_tokens, num_heads, rank)  # [N, H, R]
    for group in plan.groups:
        o = _attend_group(q_all, kv_flat, group, rank, scale)  # [g * Q, H, R]
        rows = o if group.rows is None else o.index_select(0, group.rows)
        assert group.dst is not None
        out.index_copy_(0, group.dst, rows.to(out.dtype))
    return out


def _plan_group(
    block_tables: Tensor,  # [g, max_blocks]
    ctx: Tensor,  # [g] int64
    starts: Tensor,  # [g] int64 first token of each sequence
    num_new: Tensor,  # [g] int64
    kv_lens: Tensor,  # [g] int64 ctx + num_new
    new_mask: Tensor,  # [N, M] bool
    query_ctx_lens: Tensor | None,  # [N] int32
    max_q: int,
    max_s: int,
    block_size: int,
    num_tokens: int,
) -> _GroupPlan:
    """Key slots, query rows and visibility of ``g`` sequences padded to ``max_q`` x ``max_s``."""
    g = block_tables.shape[0]
    device = new_mask.device
    pos = torch.arange(max_s, device=device)  # [S] key positions
    block_col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)  # [S]
    blocks = block_tables.long()[:, block_col]  # [g, S]
    key_ok = pos[None, :] < kv_lens[:, None]  # [g, S]
    slots = torch.where(key_ok, blocks.clamp(min=0) * block_size + pos % block_size, 0)  # [g, S]

    qpos = torch.arange(max_q, device=device)  # [Q]
    q_ok = qpos[None, :] < num_new[:, None]  # [g, Q]
    qidx = torch.where(q_ok, starts[:, None] + qpos[None, :], 0)  # [g, Q] token index

    # Committed keys: pos < ctx_b, or pos < query_ctx_lens[n] when given.
    committed_limit = ctx[:, None].expand(g, max_q)  # [g, Q]
    if query_ctx_lens is not None:
        committed_limit = query_ctx_lens.long()[qidx]  # [g, Q]
    visible = pos[None, None, :] < committed_limit[:, :, None]  # [g, Q, S]
    # New keys: j = pos - ctx_b in [0, num_new_b), visible where new_mask[n, j].
    j = pos[None, :] - ctx[:, None]  # [g, S]
    is_new = (j >= 0) & key_ok  # [g, S]
    j_col = j.clamp(0, new_mask.shape[1] - 1)[:, None, :].expand(g, max_q, max_s)  # [g, Q, S]
    visible |= new_mask[qidx].gather(2, j_col) & is_new[:, None, :]  # [g, Q, S]
    bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    keep = (q_ok & visible.any(dim=-1)).view(-1)  # [g * Q] real queries that see a key
    rows = keep.nonzero().view(-1)  # [K]
    dst = qidx.view(-1)[rows]  # [K]
    if rows.shape[0] == g * max_q == num_tokens and bool((dst == torch.arange(num_tokens, device=device)).all()):
        return _GroupPlan(max_q, slots, qidx, bias[:, :, None, :], None, None)
    return _GroupPlan(max_q, slots, qidx, bias[:, :, None, :], rows, dst)


def _attend_group(
    q_all: Tensor,  # [N, H, R + P]
    kv_flat: Tensor,  # [num_slots, R + P]
    plan: _GroupPlan,
    rank: int,
    scale: float,
) -> Tensor:  # [g * Q, H, R] float32, padded query rows included
    """One layer's attention for a planned group of ``g`` sequences."""
    g, max_q = plan.qidx.shape
    max_s = plan.slots.shape[1]
    num_heads, entry_dim = q_all.shape[1], q_all.shape[2]
    keys = kv_flat[plan.slots].float()  # [g, S, R + P]
    q = q_all[plan.qidx].float().mul_(scale).view(g, max_q * num_heads, entry_dim)  # [g, Q*H, R + P]
    scores = torch.bmm(q, keys.transpose(1, 2)).view(g, max_q, num_heads, max_s)  # [g, Q, H, S]
    probs = torch.softmax(scores.add_(plan.bias), dim=-1)  # rows with no key: NaN (dropped)
    values = keys[:, :, :rank]  # [g, S, R]
    o = torch.bmm(probs.view(g, max_q * num_heads, max_s), values)  # [g, Q*H, R]
    return o.view(g * max_q, num_heads, rank)
