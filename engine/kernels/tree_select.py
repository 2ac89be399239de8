"""Fused Triton kernels for the graphed greedy tree's selection (``GraphedGreedyTree._tree``).

After drafting, the step keeps the ``N`` best of its ``T`` candidates and lays them out as a
tree: node tokens, parents, depths and the 2D ancestor mask the verify forward attends with.
In PyTorch (``engine.spec.device_tree.select_nodes`` and ``ancestor_mask``) that is ~35 small
kernels (a float64 top-k, a sort, scatters, a gather per depth for the mask); here it is two:

1. ``_rank_kernel``, grid ``(B,)``: each candidate's rank by ``select_nodes``'s key, the
   float64 score less ``index * 1e-9`` (parents win ties with their children, so the selection
   is ancestor-closed; the index term comes precomputed as ``select_nodes`` computes it),
   counted over chunks of the candidates; the ``N`` best are selected and numbered in creation
   order by a prefix sum. Writes the selected candidates [B, N] (ascending)
   and each candidate's node number [B, T] (0: not selected).
2. ``_tables_kernel``, grid ``(B,)``: per node, its candidate's token, depth and parent node
   (the node number of the candidate's parent), the root first; then the ancestor mask, walking
   every node up ``DEPTH`` parents at once (each step a load of the parents just written).

Outputs equal the PyTorch path's exactly (the same float64 keys; exact ties of two keys, which
the torch top-k breaks in no documented order, go to the earlier candidate here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 32  # candidates compared per pass of the rank count


@triton.jit
def _key(row_ptr, tie_ptr, i, ok):
    """``select_nodes``'s key of candidates ``i``: the float64 score less index * 1e-9."""
    score = tl.load(row_ptr + i, mask=ok, other=0.0).to(tl.float64)
    return score - tl.load(tie_ptr + i, mask=ok, other=0.0)


@triton.jit
def _rank_kernel(
    score_ptr,  # [B, T] float32 cumulative draft log-probabilities
    tie_ptr,  # [T] float64: index * 1e-9, as select_nodes computes it
    sel_ptr,  # [B, N] int64 out: selected candidates, ascending
    node_ptr,  # [B, T] int64 out: node number of each candidate (1..N), 0 if not selected
    T, N: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    ok = i < T
    key = _key(score_ptr + b * T, tie_ptr, i, ok)
    rank = tl.zeros([BLOCK_T], dtype=tl.int32)  # candidates that beat candidate i
    for j0 in range(0, T, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        ok_j = j < T
        key_j = _key(score_ptr + b * T, tie_ptr, j, ok_j)
        beats = (key_j[None, :] > key[:, None]) | ((key_j[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((beats & ok_j[None, :]).to(tl.int32), axis=1)
    chosen = ok & (rank < N)
    node = tl.cumsum(chosen.to(tl.int32), axis=0)  # creation order among the chosen, from 1
    tl.store(node_ptr + b * T + i, tl.where(chosen, node, 0).to(tl.int64), mask=ok)
    tl.store(sel_ptr + b * N + node - 1, i.to(tl.int64), mask=chosen)


@triton.jit
def _tables_kernel(
    sel_ptr, node_ptr,  # [B, N], [B, T] from _rank_kernel
    cand_par_ptr, cand_tok_ptr,  # [B, T] int64: candidate index of each parent (-1: the root), token
    cand_depth_ptr,  # [T] int64
    root_ptr,  # [B] int64 root tokens
    tok_ptr, par_ptr, depth_ptr,  # [B, N+1] int64 out
    mask_ptr,  # [B, N+1, N+1] bool out
    T, N: tl.constexpr, DEPTH: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = N + 1
    x = tl.arange(0, BLOCK_N)  # node index
    live = x < n
    real = (x >= 1) & live  # every node but the root
    cand = tl.load(sel_ptr + b * N + x - 1, mask=real, other=0)
    cand_par = tl.load(cand_par_ptr + b * T + cand, mask=real, other=-1)
    parent = tl.load(node_ptr + b * T + cand_par, mask=real & (cand_par >= 0), other=0)
    tok = tl.load(cand_tok_ptr + b * T + cand, mask=real, other=0)
    tok = tl.where(x == 0, tl.load(root_ptr + b), tok)
    depth = tl.load(cand_depth_ptr + cand, mask=real, other=0)
    tl.store(tok_ptr + b * n + x, tok, mask=live)
    tl.store(par_ptr + b * n + x, parent, mask=live)
    tl.store(depth_ptr + b * n + x, depth, mask=live)
    # mask[x, y]: node y is node x or one of its ancestors (the root is its own parent). Each
    # step up reads the parents just stored (a barrier makes every thread's stores visible):
    # one [BLOCK_N] load, where a one-hot reduction over [BLOCK_N, BLOCK_N] took ~1.3 us a step.
    tl.debug_barrier()
    cur = x
    mask = x[:, None] < 0  # all False, [BLOCK_N, BLOCK_N]
    for _ in tl.static_range(DEPTH + 1):
        mask = mask | (x[None, :] == cur[:, None])  # [x, y]: y is x's current ancestor
        cur = tl.load(par_ptr + b * n + cur, mask=live, other=0)
    both = live[:, None] & live[None, :]
    tl.store(mask_ptr + b * n * n + x[:, None] * n + x[None, :], mask, mask=both)


def select_tree_triton(
    scores: Tensor,  # [B, T] float32 cumulative draft log-probability of each candidate
    tie: Tensor,  # [T] float64: index * 1e-9
    cand_parents: Tensor,  # [B, T] candidate index of each parent, -1 for children of the root
    cand_tokens: Tensor,  # [B, T]
    cand_depth: Tensor,  # [T]
    root_tokens: Tensor,  # [B]
    num_nodes: int,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens [B, N+1], parents [B, N+1], depths [B, N+1], ancestor mask [B, N+1, N+1] bool)
    of the tree of the ``num_nodes`` best candidates, root first (see the module docstring)."""
    B, T = scores.shape
    N, dev = num_nodes, scores.device
    sel = torch.empty(B, N, dtype=torch.int64, device=dev)
    node_of = torch.empty(B, T, dtype=torch.int64, device=dev)
    block_t = triton.next_power_of_2(max(T, 2))
    _rank_kernel[(B,)](scores.float().contiguous(), tie, sel, node_of, T, N=N, BLOCK_T=block_t, CHUNK=min(CHUNK, block_t),
                       num_warps=4 if block_t <= 128 else 8)  # fmt: skip
    tokens = torch.empty(B, N + 1, dtype=torch.int64, device=dev)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    mask = torch.empty(B, N + 1, N + 1, dtype=torch.bool, device=dev)
    block_n = triton.next_power_of_2(N + 1)  # the mask's [BLOCK_N, BLOCK_N] walk: 8 warps from 64
    _tables_kernel[(B,)](
        sel, node_of, cand_parents.long().contiguous(), cand_tokens.long().contiguous(),
        cand_depth.long().contiguous(), root_tokens.long().contiguous(), tokens, parents, depths, mask,
        T, N=N, DEPTH=max_depth, BLOCK_N=block_n, num_warps=4 if block_n <= 32 else 8,
    )  # fmt: skip
    return tokens, parents, depths, mask
