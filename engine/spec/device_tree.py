"""Batched draft-tree algebra on the device: selection, tree mask, greedy and sampled acceptance.

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

from engine.kernels import run_kernel, triton_available
from engine.sampling import probs_from_logits, temperature_softmax
from engine.simulator.tree_shape import TreeShape

TIE_BREAK = 1e-9  # per candidate index, in float64: parents (earlier) win ties with children
_TINY = torch.finfo(torch.float32).tiny  # keeps exponential-race keys finite


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


def logprob_topk(
    logits: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None, fused: bool | None = None
) -> tuple[Tensor, Tensor]:
    """``log_softmax(logits, -1)`` (float32) and its top ``k`` (values descending, indices):
    one fused kernel on CUDA with Triton (``fused``: None for that, else whether to), else
    ``topk_last`` of the log-softmax. ``out``: [R, k] views to write them into (2-D logits)."""
    if (logits.is_cuda and triton_available()) if fused is None else fused:
        from engine.kernels.logprob_topk import MAX_VOCAB, logprob_topk_triton

        if logits.shape[-1] <= MAX_VOCAB:
            result = run_kernel("logprob_topk", lambda: logprob_topk_triton(logits, k, out))
            if result is not None:
                return result
    values, index = topk_last(torch.log_softmax(logits, dim=-1, dtype=torch.float32), k)
    if out is None:
        return values, index
    out[0].copy_(values)
    out[1].copy_(index)
    return out


def race_draw(
    logits: Tensor, temperature: Tensor, rows_per_temp: int, k: int, fused: bool | None = None,
    top_k: Tensor | None = None, top_p: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """For logits [R, V] of sampled rows: the law ``softmax(logits / T)`` [R, V] float32 (row
    ``r`` at ``temperature[r // rows_per_temp]``) and ``k`` draws from it without replacement
    by an exponential race: the ``k`` largest keys ``q / E`` [R, k] (0: the law had no mass
    left for that draw) and their tokens [R, k] (the order of the draws). ``k = 0``: the law
    only. With ``top_k`` and ``top_p`` (per group, like ``temperature``; 0 and 1.0: off) the
    law is ``probs_from_logits``'s, filtered by them. The noise ``E`` is drawn here from the
    default generator (graph-safe). One fused kernel on CUDA with Triton (``fused``: None for
    that, else whether to); else torch ops (``race_draw_torch``)."""
    R, V = logits.shape
    if temperature.shape[0] * rows_per_temp != R:
        raise ValueError(f"{R} rows do not make {temperature.shape[0]} groups of {rows_per_temp}")
    if (top_k is None) != (top_p is None):
        raise ValueError("race_draw filters with both top_k and top_p or with neither")
    noise = torch.empty(R, V, device=logits.device).exponential_() if k > 0 else None  # [R, V]
    if (logits.is_cuda and triton_available()) if fused is None else fused:
        from engine.kernels.race_draw import MAX_FILTER_VOCAB, MAX_VOCAB, race_draw_triton

        if V <= (MAX_VOCAB if top_k is None else MAX_FILTER_VOCAB):
            # Named apart: a filtered program that fails to build leaves the plain one in use.
            name = "race_draw" if top_k is None else "race_draw_filtered"
            result = run_kernel(name, lambda: race_draw_triton(
                logits, temperature, rows_per_temp, noise, k, top_k, top_p))  # fmt: skip
            if result is not None:
                return result
    return race_draw_torch(logits, temperature, rows_per_temp, noise, k, top_k, top_p)


def warm_race_draw(device: torch.device, vocab: int, dtype: torch.dtype) -> None:
    """Compile ``race_draw``'s fused programs for logits of ``dtype`` over ``vocab`` tokens,
    with and without top-k / top-p, before a request needs them: Triton compiles a program
    on its first launch, and the sorting one took seconds (a request's first token would wait
    for it). Nothing to do off CUDA or without Triton."""
    if device.type != "cuda" or not triton_available():
        return
    logits = torch.zeros(1, vocab, dtype=dtype, device=device)  # [1, V]
    one = torch.ones(1, device=device)
    race_draw(logits, one, 1, 1)
    race_draw(logits, one, 1, 1, None, torch.zeros(1, dtype=torch.int32, device=device), one)


def race_draw_torch(
    logits: Tensor, temperature: Tensor, rows_per_temp: int, noise: Tensor | None, k: int,
    top_k: Tensor | None = None, top_p: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``race_draw`` as torch ops, on given noise [R, V] (None with ``k = 0``)."""
    def per_row(t: Tensor) -> Tensor:  # [G] -> [R]
        return t[:, None].expand(-1, rows_per_temp).reshape(-1)

    temp = per_row(temperature.to(torch.float32))
    if top_k is None or top_p is None:
        q = temperature_softmax(logits, temp)  # [R, V]
    else:
        q = probs_from_logits(logits, temp, per_row(top_k), per_row(top_p), filters=True)  # [R, V]
    if k == 0 or noise is None:
        empty = q.new_empty(q.shape[0], 0)
        return q, empty, empty.long()
    return q, *race_topk(q, noise, k)


def race_topk(probs: Tensor, noise: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest exponential-race keys ``probs / noise`` of each row [..., k] (0: no
    mass left for that draw) and their tokens [..., k]: ``k`` draws without replacement from
    ``probs`` [..., V] (unnormalised is fine), given exponential ``noise`` of its shape."""
    return (probs / noise.clamp(min=_TINY)).topk(k, -1)


_TIES: dict[tuple[int, torch.device], Tensor] = {}


def tie_breaks(T: int, device: torch.device) -> Tensor:  # [T] float64
    """``index * TIE_BREAK`` of ``T`` candidates (what ``select_nodes`` subtracts from their
    scores), made once per size and device: the graphed step reads it as a constant."""
    key = (T, torch.device(device))
    if key not in _TIES:
        _TIES[key] = torch.arange(T, device=device, dtype=torch.float64) * TIE_BREAK
    return _TIES[key]


def grow_frontier(
    front_score: Tensor,  # [B, K] cumulative score of each frontier node
    front_idx: Tensor,  # [B, K] its candidate index
    child_logp: Tensor,  # [B, K, K] log-probability of each node's K best children
    child_tok: Tensor,  # [B, K, K] their tokens
    front_hidden: Tensor,  # [B, K, H] the frontier rows' hidden states
    offset: int,  # candidate index of this depth's first child
    out: tuple[Tensor, Tensor, Tensor] | None = None,  # [B, K*K] views for the candidates
    fused: bool | None = None,  # the Triton kernel (None: on CUDA with Triton)
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One depth of the greedy tree's growth: the depth's ``K * K`` candidates (cumulative
    scores, tokens, parent candidate indices [B, K*K], written into ``out`` when given) and the
    next frontier, their ``K`` best (scores, candidate indices, tokens [B, K], their parents'
    hidden rows [B, K, H]). On CUDA with Triton one fused kernel (``engine.kernels.tree_grow``);
    else torch ops."""
    if (front_hidden.is_cuda and triton_available()) if fused is None else fused:
        from engine.kernels.tree_grow import grow_frontier_triton

        result = run_kernel("grow_frontier", lambda: grow_frontier_triton(
            front_score, front_idx, child_logp, child_tok, front_hidden, offset, out))  # fmt: skip
        if result is not None:
            return result
    grown = grow_frontier_torch(front_score, front_idx, child_logp, child_tok, front_hidden, offset)
    if out is None:
        return grown
    for dst, src in zip(out, grown[:3], strict=True):
        dst.copy_(src)
    return (*out, *grown[3:])


def grow_frontier_torch(
    front_score: Tensor, front_idx: Tensor, child_logp: Tensor, child_tok: Tensor,
    front_hidden: Tensor, offset: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``grow_frontier`` as torch ops (the reference of the fused kernel)."""
    B, K, H = front_hidden.shape
    score = (front_score[:, :, None] + child_logp).reshape(B, K * K)
    tok = child_tok.reshape(B, K * K)
    parents = front_idx[:, :, None].expand(B, K, K).reshape(B, K * K)
    new_score, pick = score.topk(K, -1)  # [B, K]
    hidden = front_hidden.gather(1, (pick // K)[:, :, None].expand(B, K, H))
    return score, tok, parents, new_score, pick + offset, tok.gather(1, pick), hidden


def select_tree(
    scores: Tensor,  # [B, T] cumulative draft log-probability of each candidate
    cand_parents: Tensor,  # [B, T] candidate index of the parent, -1 for children of the root
    cand_tokens: Tensor,  # [B, T]
    cand_depth: Tensor,  # [T] depth of each candidate
    root_tokens: Tensor,  # [B]
    num_nodes: int,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The tree of the ``num_nodes`` best candidates (``select_nodes``): tokens, parents and
    depths [B, N+1] (root first) and its ancestor mask [B, N+1, N+1]. On CUDA with Triton two
    fused kernels (``engine.kernels.tree_select``); else torch ops."""
    if scores.is_cuda and triton_available():
        from engine.kernels.tree_select import select_tree_triton

        tie = tie_breaks(scores.shape[1], scores.device)
        fused = run_kernel("select_tree", lambda: select_tree_triton(
            scores, tie, cand_parents, cand_tokens, cand_depth, root_tokens, num_nodes, max_depth))  # fmt: skip
        if fused is not None:
            return fused
    return select_tree_torch(scores, cand_parents, cand_tokens, cand_depth, root_tokens, num_nodes, max_depth)


def select_tree_torch(
    scores: Tensor, cand_parents: Tensor, cand_tokens: Tensor, cand_depth: Tensor,
    root_tokens: Tensor, num_nodes: int, max_depth: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``select_tree`` as torch ops (the reference of the fused kernels)."""
    sel, parents = select_nodes(scores, cand_parents, num_nodes)  # [B, N], [B, N+1]
    root = root_tokens[:, None].long()  # [B, 1]
    tokens = torch.cat([root, cand_tokens.long().gather(1, sel)], 1)
    depths = torch.cat([torch.zeros_like(root), cand_depth[sel].long()], 1)
    return tokens, parents, depths, ancestor_mask(parents, max_depth)


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
    key = scores.double() - tie_breaks(T, scores.device)
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
class AcceptedPath:
    """Accepted path of each tree (padded to ``max_depth + 1``), greedy or sampled."""

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
) -> AcceptedPath:
    """A node is accepted when its token is the target's argmax at its parent and its parent is
    accepted; siblings carry different tokens, so the accepted nodes form one path.

    On CUDA with Triton, one fused kernel (``engine.kernels.tree_accept``); else torch ops."""
    if tokens.is_cuda and triton_available():
        from engine.kernels.tree_accept import accept_greedy_triton

        fused = run_kernel("accept_greedy", lambda: accept_greedy_triton(tokens, parents, target, max_depth))
        if fused is not None:
            a, path, bonus, has_child, rank, on_path = fused
            return AcceptedPath(a, path, on_path, bonus, has_child, rank)
    return accept_greedy_torch(tokens, parents, depths, target, max_depth)


def accept_greedy_torch(
    tokens: Tensor, parents: Tensor, depths: Tensor, target: Tensor, max_depth: int
) -> AcceptedPath:
    """``accept_greedy`` as torch ops (the reference of the fused kernel)."""
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
    return AcceptedPath(a, path, j[None] <= a, target.gather(1, best), has_child, rank)


@dataclass
class StaticTree:
    """A fixed tree shape as device tables, for sampled acceptance (``accept_sampled``)."""

    children: Tensor  # [N+1, W] children in draw order, -1 padded
    q_row: Tensor  # [N+1] row of the node's draft law among the internal nodes (0 for leaves)
    has_child: Tensor  # [N+1] bool
    ranks: Tensor  # [N+1] sibling rank (draw order), 0 for the root
    level_width: list[int]  # [d] most children of a node at depth d

    @property
    def max_depth(self) -> int:
        return len(self.level_width)

    @classmethod
    def build(cls, shape: TreeShape, internal: list[int], device: torch.device) -> StaticTree:
        """``internal``: the nodes with children, in the order of their draft-law rows."""
        kids = [shape.children(i) for i in range(shape.num_nodes)]
        width = max(len(c) for c in kids)
        depths = shape.depths
        return cls(
            children=torch.tensor([c + [-1] * (width - len(c)) for c in kids], device=device),
            q_row=torch.tensor([internal.index(i) if kids[i] else 0 for i in range(shape.num_nodes)],
                               device=device),  # fmt: skip
            has_child=torch.tensor([bool(c) for c in kids], device=device),
            ranks=torch.tensor([0, *shape.ranks[1:]], device=device),
            level_width=[max(len(kids[i]) for i in range(shape.num_nodes) if depths[i] == d)
                         for d in range(shape.max_depth)],  # fmt: skip
        )


def residual(p: Tensor, q: Tensor) -> Tensor:  # [B, V] -> [B, V]
    """``max(p - q, 0)``, unnormalised: the target law left after a rejected draw from ``q``."""
    return (p - q).clamp(min=0.0)


def accept_sampled(
    tokens: Tensor,  # [B, N+1] node tokens (root first)
    valid: Tensor,  # [B, N+1] bool, False for draws that had no mass (never accepted)
    p_all: Tensor,  # [B, N+1, V] target law after each node (normalised)
    q_all: Tensor,  # [B, I, V] draft law each internal node's children were drawn from
    tree: StaticTree,
) -> AcceptedPath:
    """Multi-draft recursive rejection sampling on every tree at once (no host reads); the
    randomness (``accept_sampled_torch``'s ``uniforms`` and ``noise``) is drawn here from the
    default generator. On CUDA with Triton, one fused kernel (``engine.kernels.sampled_accept``,
    the same decisions on the same draws); else torch ops."""
    B, V = tokens.shape[0], p_all.shape[-1]
    uniforms = torch.rand(B, tree.max_depth, tree.children.shape[1], device=tokens.device)
    noise = torch.empty(B, V, device=tokens.device).exponential_().clamp_(min=_TINY)
    if tokens.is_cuda and triton_available():
        from engine.kernels.sampled_accept import accept_sampled_triton

        fused = run_kernel("accept_sampled", lambda: accept_sampled_triton(
            tokens, valid, p_all.float(), q_all.float(), tree.children, tree.q_row, uniforms, noise))  # fmt: skip
        if fused is not None:
            num, path_t, bonus = fused
            a = num[:, None]  # [B, 1]
            j = torch.arange(tree.max_depth + 1, device=tokens.device)
            return AcceptedPath(a, path_t, j[None] <= a, bonus[:, None], tree.has_child[path_t],
                                tree.ranks[path_t])  # fmt: skip
    return accept_sampled_torch(tokens, valid, p_all, q_all, tree, uniforms, noise)


def accept_sampled_torch(
    tokens: Tensor,  # [B, N+1] node tokens (root first)
    valid: Tensor,  # [B, N+1] bool, False for draws that had no mass (never accepted)
    p_all: Tensor,  # [B, N+1, V] target law after each node (normalised)
    q_all: Tensor,  # [B, I, V] draft law each internal node's children were drawn from
    tree: StaticTree,
    uniforms: Tensor,  # [B, D, W] the acceptance test of sibling r (draw order) at depth d
    noise: Tensor,  # [B, V] exponentials: the bonus is argmax p / noise (a draw from p)
) -> AcceptedPath:
    """Multi-draft recursive rejection sampling, as torch ops over the whole batch.

    The tensor form of ``engine.spec.verifier.verify_sampling`` for children drawn without
    replacement: at the current node, children are tried in draw order; ``x`` is accepted with
    probability ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))`` and ``q <- q``
    without ``x``, renormalised. When no child is accepted (or the node is a leaf) the bonus is
    drawn from the current ``p``. A rejection whose residual has no mass in floating point keeps
    ``p`` (a rounding-level event, as in the host verifier).
    """
    B = tokens.shape[0]
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # [B] current node
    p = p_all[:, 0]  # [B, V]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    path = [cur]
    for level in range(tree.max_depth):
        q = q_all[rows, tree.q_row[cur]]  # [B, V] law of cur's first draw
        moved = torch.zeros_like(done)
        nxt = cur
        for r in range(tree.level_width[level]):
            child = tree.children[cur, r]  # [B], -1: no such child
            safe = child.clamp(min=0)
            x = tokens[rows, safe]  # [B]
            tried = ~done & ~moved & (child >= 0) & valid[rows, safe]
            px, qx = p[rows, x], q[rows, x]  # [B]
            accept = tried & (uniforms[:, level, r] * qx < px)
            moved |= accept
            nxt = torch.where(accept, safe, nxt)
            reject = (tried & ~accept)[:, None]  # [B, 1]
            rest = residual(p, q)  # [B, V]
            mass = rest.sum(-1, keepdim=True)
            p = torch.where(reject & (mass > 0), rest / mass.clamp(min=_TINY), p)
            q_rest = q.scatter(1, x[:, None], 0.0)  # the next draw's law: q without x
            q_mass = q_rest.sum(-1, keepdim=True)
            q = torch.where(reject & (q_mass > 0), q_rest / q_mass.clamp(min=_TINY), q)
        done |= ~moved
        cur = nxt
        p = torch.where(moved[:, None], p_all[rows, cur], p)
        path.append(cur)
    race = p / noise  # exponential race
    bonus = race.argmax(-1, keepdim=True)  # [B, 1] drawn from the final (residual) law
    path_t = torch.stack(path, 1)  # [B, D+1] (repeats once stopped)
    a = (path_t[:, 1:] != path_t[:, :-1]).sum(-1, keepdim=True)  # [B, 1]
    j = torch.arange(tree.max_depth + 1, device=dev)
    return AcceptedPath(a, path_t, j[None] <= a, bonus, tree.has_child[path_t], tree.ranks[path_t])
