"""Batched draft-tree algebra on the device: selection, tree mask, greedy acceptance.

Pure tensor functions with static shapes (no host reads), used by the graphed greedy step
(``engine.spec.graphed_tree``) and testable against the host implementations
(``engine.spec.tree.select_best_nodes``, ``engine.spec.verifier.verify_greedy``).

Conventions: B trees of ``N + 1`` nodes each; node 0 is the root; ``parents[b, i] < i`` for
``i >= 1`` and ``parents[b, 0] = 0`` (the root is its own parent, which keeps gathers in range).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TIE_BREAK = 1e-9  # per candidate index, in float64: parents (earlier) win ties with children


def topk_last(x: Tensor, k: int, chunk: int = 128) -> tuple[Tensor, Tensor]:
    """``x.topk(k, -1)`` (values descending, indices) in two stages: the top ``k`` of every
    ``chunk`` of the last dim, then the top ``k`` of those.

    A vocabulary-wide top-k of a few rows gets one GPU block per row (tens of microseconds for
    V = 8192); the two stages spread the first pass over ``V / chunk`` blocks per row. Same
    result as one top-k but for the order of equal values.
    """
    V = x.shape[-1]
    if V % chunk or V < 2 * chunk or k > chunk:
        return x.topk(k, -1)
    values, index = x.unflatten(-1, (V // chunk, chunk)).topk(k, -1)  # [..., V/chunk, k]
    index = index + torch.arange(0, V, chunk, device=x.device)[:, None]  # vocabulary ids
    best, pick = values.flatten(-2).topk(k, -1)  # [..., k]
    return best, index.flatten(-2).gather(-1, pick)


def select_nodes(
    scores: Tensor,  # [B, T] cumulative draft log-probability of each candidate
    cand_parents: Tensor,  # [B, T] candidate index of the parent, -1 for children of the root
    num_nodes: int,
) -> tuple[Tensor, Tensor]:  # [B, N] selected candidates (ascending), [B, N+1] node parents
    """The ``num_nodes`` best candidates, in creation order, and their parents as node indices.

    A child's score never exceeds its parent's and ties go to the earlier candidate, so the
    selection is ancestor-closed whenever parents are created before their children.
    """
    B, T = scores.shape
    order = torch.arange(T, device=scores.device, dtype=torch.float64)
    key = scores.double() - order * TIE_BREAK
    sel = key.topk(num_nodes, -1).indices.sort(-1).values  # [B, N]
    node_of = torch.zeros(B, T, dtype=torch.long, device=scores.device)
    node_of.scatter_(1, sel, torch.arange(1, num_nodes + 1, device=scores.device).expand(B, num_nodes))
    sel_parent = cand_parents.gather(1, sel)  # [B, N]
    parent = torch.where(sel_parent < 0, 0, node_of.gather(1, sel_parent.clamp(min=0)))
    root = torch.zeros(B, 1, dtype=torch.long, device=scores.device)
    return sel, torch.cat([root, parent], 1)


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:  # [B, N+1, N+1] bool
    """``mask[b, i, j]``: node j is node i or one of its ancestors (the 2D tree mask)."""
    B, n = parents.shape
    cur = torch.arange(n, device=parents.device).expand(B, n)
    mask = torch.zeros(B, n, n, dtype=torch.bool, device=parents.device)
    for _ in range(max_depth + 1):
        mask.scatter_(2, cur[:, :, None], True)
        cur = parents.gather(1, cur)
    return mask


@dataclass
class GreedyAcceptance:
    """Accepted path of each tree (padded to ``max_depth + 1``)."""

    num_accepted: Tensor  # [B, 1] accepted drafts a
    path: Tensor  # [B, D+1] node indices root .. deepest accepted (entries past a repeat)
    on_path: Tensor  # [B, D+1] bool, j <= a
    bonus: Tensor  # [B, 1] the target's token after the last accepted node
    has_child: Tensor  # [B, D+1] bool: the path node at depth j had children in the tree
    sibling_rank: Tensor  # [B, D+1] rank of the path node among its siblings (score order)


def accept_greedy(
    tokens: Tensor,  # [B, N+1] node tokens (root first)
    parents: Tensor,  # [B, N+1]
    depths: Tensor,  # [B, N+1]
    target: Tensor,  # [B, N+1] target argmax at each node
    max_depth: int,
) -> GreedyAcceptance:
    """A node is accepted when its token is the target's argmax at its parent and its parent is
    accepted; siblings carry different tokens, so the accepted nodes form one path."""
    B, n = tokens.shape
    node = torch.arange(n, device=tokens.device)
    match = tokens == target.gather(1, parents)
    is_root = node[None] == 0
    acc = is_root.expand(B, n)
    for _ in range(max_depth):
        acc = (match & acc.gather(1, parents)) | is_root
    best = torch.where(acc, depths, -1).argmax(-1, keepdim=True)  # [B, 1] deepest accepted
    a = depths.gather(1, best)
    up = [best]
    for _ in range(max_depth):
        up.append(parents.gather(1, up[-1]))
    chain = torch.cat(up, 1)  # [B, D+1] best, parent, grandparent, ...
    j = torch.arange(max_depth + 1, device=tokens.device)
    path = chain.gather(1, (a - j).clamp(min=0))
    has_child = (parents[:, None, 1:] == path[:, :, None]).any(-1)
    path_parent = parents.gather(1, path)
    rank = ((parents[:, None, :] == path_parent[:, :, None]) & (node < path[:, :, None]) & (node >= 1)).sum(-1)
    return GreedyAcceptance(a, path, j[None] <= a, target.gather(1, best), has_child, rank)
