"""Fused Triton kernel for ``engine.spec.device_tree.accept_greedy``: one launch for all trees.

Grid ``(B,)``: program ``b`` loads tree ``b`` (tokens, parents, target argmax of its ``n``
nodes) into registers and walks it from the root: at each depth the child of the current node
whose token is the target's argmax there is accepted (siblings carry different tokens, so there
is at most one). For every node of the padded path it also writes whether the node has children
in the tree and its rank among its siblings. The PyTorch version (``accept_greedy``) does the
same with ~40 small kernels (a gather per depth for the acceptance, the path and the ranks);
inside the graphed step this is one.

Outputs, as ``accept_greedy``: accepted count ``a`` [B, 1]; the path [B, D + 1] (node indices,
root first; entries past ``a`` repeat the deepest accepted node); the bonus token [B, 1] (the
target at that node); has-children [B, D + 1]; sibling rank [B, D + 1]; on the path [B, D + 1]
(depth ``j <= a``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _pick(values, idx, at):
    """``values[at]`` of a register vector (``at`` a scalar index)."""
    return tl.sum(tl.where(idx == at, values, 0), axis=0)


@triton.jit
def _accept_greedy_kernel(
    tok_ptr, par_ptr, tgt_ptr,  # [B, n] int64
    num_ptr, path_ptr, bonus_ptr, child_ptr, rank_ptr, on_path_ptr,  # outputs
    n, DEPTH: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)  # [BLOCK] node index
    ok = idx < n
    tok = tl.load(tok_ptr + b * n + idx, mask=ok, other=-1)
    par = tl.load(par_ptr + b * n + idx, mask=ok, other=-1)
    tgt = tl.load(tgt_ptr + b * n + idx, mask=ok, other=-1)
    node = (idx >= 1) & ok  # every node but the root
    out = b * (DEPTH + 1)
    cur = tl.sum(tl.where(idx == 0, idx, 0), axis=0)  # the root: 0 (an int64 scalar)
    num = cur
    for d in tl.static_range(DEPTH + 1):
        if d > 0:
            want = _pick(tgt, idx, cur)  # the target's token after the current node
            match = node & (par == cur) & (tok == want)
            child = tl.max(tl.where(match, idx, -1), axis=0)
            found = child >= 0
            cur = tl.where(found, child, cur)
            num += found.to(tl.int64)
        sibling_of = _pick(par, idx, cur)
        has_child = tl.max((node & (par == cur)).to(tl.int32), axis=0)
        rank = tl.sum((node & (par == sibling_of) & (idx < cur)).to(tl.int64), axis=0)
        tl.store(path_ptr + out + d, cur)
        tl.store(child_ptr + out + d, has_child != 0)
        tl.store(rank_ptr + out + d, rank)
    tl.store(num_ptr + b, num)
    tl.store(bonus_ptr + b, _pick(tgt, idx, cur))
    for d in tl.static_range(DEPTH + 1):
        tl.store(on_path_ptr + out + d, d <= num)


def accept_greedy_triton(
    tokens: Tensor,  # [B, n] node tokens (root first)
    parents: Tensor,  # [B, n]
    target: Tensor,  # [B, n] target argmax at each node
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(accepted [B, 1], path [B, D+1], bonus [B, 1], has_child [B, D+1] bool, rank [B, D+1],
    on_path [B, D+1] bool)."""
    B, n = tokens.shape
    dev = tokens.device
    num = torch.empty(B, 1, dtype=torch.int64, device=dev)
    path = torch.empty(B, max_depth + 1, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, 1, dtype=torch.int64, device=dev)
    has_child = torch.empty(B, max_depth + 1, dtype=torch.bool, device=dev)
    rank = torch.empty(B, max_depth + 1, dtype=torch.int64, device=dev)
    on_path = torch.empty(B, max_depth + 1, dtype=torch.bool, device=dev)
    _accept_greedy_kernel[(B,)](
        tokens.long().contiguous(), parents.long().contiguous(), target.long().contiguous(),
        num, path, bonus, has_child, rank, on_path,
        n, DEPTH=max_depth, BLOCK=triton.next_power_of_2(max(n, 2)),
    )  # fmt: skip
    return num, path, bonus, has_child, rank, on_path
