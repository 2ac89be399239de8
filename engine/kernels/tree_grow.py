"""Fused Triton kernel for one depth of the graphed greedy tree's growth (``GraphedGreedyTree._grow``).

At depth ``m >= 2`` each of the ``K`` frontier nodes has its ``K`` best children (scored by
``logprob_topk``); the depth's ``K * K`` candidates get their cumulative scores and parents, and
the ``K`` best of them become the next frontier, with their tokens and their parents' hidden
rows as the next MTP module's inputs. In PyTorch (``engine.spec.device_tree.grow_frontier_torch``)
that is ~8 kernels per depth (the sum, a two-kernel top-k, the index arithmetic, two gathers);
here it is one.

Grid ``(B,)``: program ``b`` loads tree ``b``'s ``K * K`` children, writes their scores (the
same float32 sums), tokens and parent candidate indices, then takes the maximum ``K`` times
(values descending; exact ties, which the torch top-k orders as it likes, to the lower index)
and copies each pick's parent row of hidden states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _grow_kernel(
    front_score_ptr, front_idx_ptr,  # [B, K] float32, int64 (candidate index of each frontier node)
    stride_fs, stride_fi,  # their batch strides (columns contiguous; 0: one row for all)
    logp_ptr, child_tok_ptr,  # [B, K, K] float32, int64: each frontier node's best children
    hidden_ptr, stride_hb, stride_hf,  # [B, K, H] frontier rows' hidden states (rows contiguous)
    score_ptr, tok_ptr, par_ptr, stride_cand,  # [B, K*K] out (row stride): the depth's candidates
    new_score_ptr, new_idx_ptr, new_tok_ptr,  # [B, K] out: the next frontier
    new_hidden_ptr,  # [B, K, H] out: its input hidden states
    offset, H, K: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_KK)  # child index within the depth: frontier node j // K
    ok = j < K * K
    score = tl.load(front_score_ptr + b * stride_fs + j // K, mask=ok, other=0.0) + tl.load(
        logp_ptr + b * K * K + j, mask=ok, other=0.0
    )
    tok = tl.load(child_tok_ptr + b * K * K + j, mask=ok, other=0)
    tl.store(score_ptr + b * stride_cand + j, score, mask=ok)
    tl.store(tok_ptr + b * stride_cand + j, tok, mask=ok)
    tl.store(par_ptr + b * stride_cand + j, tl.load(front_idx_ptr + b * stride_fi + j // K, mask=ok, other=0), mask=ok)
    left = tl.where(ok, score, float("-inf"))
    h = tl.arange(0, BLOCK_H)
    for r in tl.static_range(K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, j, BLOCK_KK), axis=0)  # the lowest index among ties
        tl.store(new_score_ptr + b * K + r, best)
        tl.store(new_idx_ptr + b * K + r, pick.to(tl.int64) + offset)
        tl.store(new_tok_ptr + b * K + r, tl.sum(tl.where(j == pick, tok, 0), axis=0))
        row = tl.load(hidden_ptr + b * stride_hb + (pick // K) * stride_hf + h, mask=h < H)
        tl.store(new_hidden_ptr + (b * K + r) * H + h, row, mask=h < H)
        left = tl.where(j == pick, float("-inf"), left)


def grow_frontier_triton(
    front_score: Tensor,  # [B, K] float32
    front_idx: Tensor,  # [B, K] int64
    child_logp: Tensor,  # [B, K, K] float32
    child_tok: Tensor,  # [B, K, K] int64
    front_hidden: Tensor,  # [B, K, H] (rows contiguous)
    offset: int,  # candidate index of the depth's first child
    out: tuple[Tensor, Tensor, Tensor] | None = None,  # where the child scores, tokens, parents go
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As ``engine.spec.device_tree.grow_frontier_torch``: (child scores, tokens, parents
    [B, K*K]; next frontier scores, candidate indices, tokens [B, K]; its hidden [B, K, H]).
    ``out``: [B, K*K] views with contiguous columns and one row stride (e.g. columns of the
    step's candidate buffers) for the first three."""
    B, K, H = front_hidden.shape
    dev = front_hidden.device
    if front_hidden.stride(-1) != 1:
        front_hidden = front_hidden.contiguous()
    if out is None:
        score = torch.empty(B, K * K, dtype=torch.float32, device=dev)
        tok = torch.empty(B, K * K, dtype=torch.int64, device=dev)
        par = torch.empty(B, K * K, dtype=torch.int64, device=dev)
    else:
        score, tok, par = out
        assert score.dtype == torch.float32 and tok.dtype == par.dtype == torch.int64
        assert score.shape == tok.shape == par.shape == (B, K * K)
        assert score.stride() == tok.stride() == par.stride() and score.stride(1) == 1
    new_score = torch.empty(B, K, dtype=torch.float32, device=dev)
    new_idx = torch.empty(B, K, dtype=torch.int64, device=dev)
    new_tok = torch.empty(B, K, dtype=torch.int64, device=dev)
    new_hidden = torch.empty(B, K, H, dtype=front_hidden.dtype, device=dev)
    # The frontier may be columns of the candidate buffers (depth 1's scores) or one row for all
    # (depth 1's indices): read in place where the columns are contiguous.
    if front_score.dtype != torch.float32 or front_score.stride(1) != 1:
        front_score = front_score.float().contiguous()
    if front_idx.dtype != torch.int64 or front_idx.stride(1) != 1:
        front_idx = front_idx.long().contiguous()
    _grow_kernel[(B,)](
        front_score, front_idx, front_score.stride(0), front_idx.stride(0), child_logp.float().contiguous(),
        child_tok.long().contiguous(), front_hidden, front_hidden.stride(0), front_hidden.stride(1),
        score, tok, par, score.stride(0), new_score, new_idx, new_tok, new_hidden,
        offset, H, K=K, BLOCK_KK=triton.next_power_of_2(max(K * K, 2)), BLOCK_H=triton.next_power_of_2(H),
    )  # fmt: skip
    return score, tok, par, new_score, new_idx, new_tok, new_hidden
