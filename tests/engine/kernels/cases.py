"""Random paged-attention inputs and a naive per-query implementation to check against.

``make_case`` scatters each sequence over shuffled (non-contiguous) blocks of a cache whose
unused slots hold large garbage, so a kernel that reads a key it should not see is caught.
``naive_attention`` builds, query by query, the explicit list of visible keys and does a
float64 softmax: no padding, no grouping, nothing shared with the code under test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

GARBAGE = 50.0  # value of never-visible cache entries


@dataclass
class AttnCase:
    q_latent: Tensor  # [N, H, R]
    q_rope: Tensor  # [N, H, P]
    kv_cache: Tensor  # [num_blocks, block_size, R + P]
    block_tables: Tensor  # [B, max_blocks] int32, -1 padded
    ctx_lens: Tensor  # [B] int32
    query_start: Tensor  # [B + 1] int32
    new_mask: Tensor  # [N, M] bool
    scale: float
    query_ctx_lens: Tensor | None  # [N] int32

    def args(self) -> tuple:
        return (self.q_latent, self.q_rope, self.kv_cache, self.block_tables, self.ctx_lens,
                self.query_start, self.new_mask, self.scale)


def random_tree_mask(num_nodes: int, rng: random.Random) -> Tensor:  # [n, n] bool
    """Mask of a random tree with parents before children: a node sees ancestors and itself."""
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for i in range(num_nodes):
        mask[i, i] = True
        if i > 0:
            mask[i] |= mask[rng.randrange(i)]
    return mask


def make_case(
    seed: int,
    ctx_lens: list[int],
    new_counts: list[int],
    *,
    mask_kind: str = "tree",  # "tree" | "causal"
    heads: int = 3,
    rank: int = 16,
    rope: int = 8,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    with_query_ctx: bool = False,
    device: str = "cpu",
) -> AttnCase:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(new_counts)
    width = max(new_counts)
    need = [-(-(c + n) // block_size) for c, n in zip(ctx_lens, new_counts, strict=True)]
    num_blocks = sum(need) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)  # non-contiguous, unordered block ids
    max_blocks = max(need) + 1
    block_tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    kv = torch.full((num_blocks, block_size, rank + rope), GARBAGE)
    taken = 0
    for b, count in enumerate(need):
        block_tables[b, :count] = torch.tensor(order[taken:taken + count], dtype=torch.int32)
        taken += count
        for pos in range(ctx_lens[b] + new_counts[b]):
            blk = int(block_tables[b, pos // block_size])
            kv[blk, pos % block_size] = torch.randn(rank + rope, generator=gen)
    new_mask = torch.zeros(num_tokens, width, dtype=torch.bool)
    start = 0
    for n in new_counts:
        if mask_kind == "tree":
            block = random_tree_mask(n, rng)
        else:
            block = torch.tril(torch.ones(n, n, dtype=torch.bool))
        new_mask[start:start + n, :n] = block
        new_mask[start:start + n, n:] = True  # padding columns must be ignored
        start += n
    query_start = torch.tensor([0] + new_counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    query_ctx = None
    if with_query_ctx:
        seq_of = [b for b, n in enumerate(new_counts) for _ in range(n)]
        query_ctx = torch.tensor([rng.randint(0, ctx_lens[b]) for b in seq_of], dtype=torch.int32)
    q_latent = torch.randn(num_tokens, heads, rank, generator=gen)
    q_rope = torch.randn(num_tokens, heads, rope, generator=gen)
    to = {"device": device}
    return AttnCase(
        q_latent.to(dtype=dtype, **to), q_rope.to(dtype=dtype, **to), kv.to(dtype=dtype, **to),
        block_tables.to(**to), torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        query_start.to(**to), new_mask.to(**to), (rank + rope) ** -0.5,
        None if query_ctx is None else query_ctx.to(**to),
    )


def naive_attention(case: AttnCase) -> Tensor:  # [N, H, R] float64
    """Per query: list the visible keys explicitly, softmax in float64."""
    q_lat, q_rope = case.q_latent.double().cpu(), case.q_rope.double().cpu()
    kv = case.kv_cache.double().cpu()
    rank = q_lat.shape[-1]
    block_size = kv.shape[1]
    tables, starts = case.block_tables.cpu(), case.query_start.cpu().tolist()
    ctx_lens = case.ctx_lens.cpu().tolist()
    mask = case.new_mask.cpu()
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    for b in range(len(ctx_lens)):
        for n in range(starts[b], starts[b + 1]):
            committed = ctx_lens[b]
            if case.query_ctx_lens is not None:
                committed = int(case.query_ctx_lens[n])
            positions = list(range(committed))
            positions += [ctx_lens[b] + j for j in range(starts[b + 1] - starts[b]) if mask[n, j]]
            if not positions:
                continue
            keys = torch.stack([
                kv[int(tables[b, p // block_size]), p % block_size] for p in positions
            ])  # [S, R + P]
            scores = (q_lat[n] @ keys[:, :rank].T + q_rope[n] @ keys[:, rank:].T) * case.scale
            out[n] = torch.softmax(scores, dim=-1) @ keys[:, :rank]  # [H, R]
    return out
