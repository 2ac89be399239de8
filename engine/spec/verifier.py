"""Acceptance of a draft tree against one target forward (greedy and exact sampling).

Terms (as in vLLM's rejection sampler):

- **draft token**: a non-root node of the tree, proposed by the MTP drafter.
- **accepted token**: a draft token the verifier keeps. Accepted nodes always form a path from
  the root; ``AcceptResult.accepted`` lists it, root (node 0) first.
- **rejected token**: a draft token that was tried and not kept; its whole subtree is dropped.
  Untried siblings (after an accepted one) are dropped too.
- **bonus token**: the one token the target contributes after the last accepted node ``a``.
  If no child of ``a`` was tried (``a`` is a leaf) it is drawn from the target distribution at
  ``a``; if children were tried and all rejected it is the **recovered** token, drawn from the
  residual distribution left by those rejections. Either way it becomes the next pending token.

Greedy (``verify_greedy``): a child is accepted iff its token is the target argmax at its parent;
the output equals plain argmax decoding token for token.

Sampling (``verify_sampling``) is multi-draft recursive rejection sampling. At the current node
with target distribution ``p`` the children are tried in sibling order:

- deterministic children (point mass ``q = δ_x``): accept with probability ``p(x)``; on
  rejection ``p ← norm(max(p - δ_x, 0))``, i.e. ``p`` with ``x`` removed, renormalised.
- sampled i.i.d. from ``q``: accept with probability ``min(1, p(x) / q(x))``; on rejection
  ``p ← norm(max(p - q, 0))`` (Leviathan et al. 2023; Chen et al. 2023; SpecInfer, Miao et al.
  2024, for several i.i.d. drafts).
- sampled without replacement from ``q`` (draw order): the same test and residual, computed with
  the current ``q``; then ``q ← q`` with ``x`` removed, renormalised, which is the law of the
  next draw (Recursive Speculative Decoding, Jeon et al. 2024).

Each test is ordinary speculative sampling of the current ``p`` with a proposal whose draw is
independent of the previous coins, so by induction the token leaving the node (an accepted child
or the recovered token) has exactly the node's target law, and recursing into an accepted child
gives the exact joint law of the emitted tokens. Deterministic children may be chosen any way
that ignores the verifier's randomness, e.g. top-k plus EAGLE-2's budget reranking (Li et al.
2024); using the drafter's softmax as ``q`` for such children would be wrong (biased).

Numerics: a rejection happens with probability equal to the residual's mass. When that mass is
not positive in floating point (``p`` and ``q`` agree to rounding, or ``p(x)`` rounds to 1) the
rejection is a rounding event whose exact conditional law is not representable; we then leave
the current ``p`` unchanged (as if the draft carried no information). The error in total
variation is at most that rejection probability, i.e. rounding level.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampling import sample_from_probs
from engine.spec.tree import DraftTree


@dataclass(frozen=True)
class AcceptResult:
    """The accepted path (node indices, root first) and the bonus token."""

    accepted: list[int]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root and bonus not counted)."""
        return len(self.accepted) - 1


def verify_greedy(tree: DraftTree, target_argmax: Tensor) -> AcceptResult:
    """Accept the path whose every token is the target's argmax at its parent.

    Args:
        tree: the draft tree.
        target_argmax: ``[N]`` int, the target's argmax next token after each node.
    Returns:
        The accepted path (first matching child at each level) and the argmax at its last node.
    """
    if target_argmax.shape != (tree.num_nodes,):
        raise ValueError(
            f"target_argmax must be [{tree.num_nodes}], got {tuple(target_argmax.shape)}"
        )
    best = [int(t) for t in target_argmax.tolist()]
    node, path = 0, [0]
    while True:
        match = next((c for c in tree.children(node) if tree.token_list[c] == best[node]), None)
        if match is None:
            return AcceptResult(accepted=path, bonus_token=best[node])
        node = match
        path.append(node)


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator, device=generator.device))


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """``max(p - q, 0)`` unnormalised ``[V]``: the target law left after a rejected draw from q."""
    return (p - q).clamp_(min=0.0)


def verify_sampling(
    tree: DraftTree, target_probs: Tensor, generator: torch.Generator
) -> AcceptResult:
    """Multi-draft recursive rejection sampling; emitted tokens have exactly the target law.

    Args:
        tree: the draft tree with its per-node ``child_q`` and sampling mode.
        target_probs: ``[N, V]`` the target's processed next-token distribution after each node
            (penalties from its own path, temperature, top-k, top-p).
        generator: the sequence's generator; every coin and draw comes from it.
    Returns:
        The accepted path and the bonus (or recovered) token.
    Raises:
        ValueError: on shape mismatches or a sampled child the draft gave probability 0.
    """
    n, _ = target_probs.shape
    if n != tree.num_nodes:
        raise ValueError(f"target_probs has {n} rows for a tree of {tree.num_nodes} nodes")
    node, path = 0, [0]
    while True:
        p = target_probs[node].float()  # [V] current target law (normalised lazily)
        children = tree.children(node)
        if not children:  # a leaf: the bonus token comes straight from the target
            return AcceptResult(accepted=path, bonus_token=sample_from_probs(p, generator))
        mass = float(p.sum())
        if not mass > 0.0:
            raise ValueError(f"target_probs row {node} has no positive mass")
        q = tree.child_q[node]  # [V] or None
        q_cur = None if q is None else q.to(p) / q.sum().to(p)  # [V] current draft law
        without_replacement = tree.child_sampled_without_replacement[node]
        owned = False  # p is a view of target_probs until we first modify it
        accepted_child = None
        for child in children:
            x = tree.token_list[child]
            px = float(p[x]) / mass
            if q_cur is None:
                if _uniform(generator) < px:
                    accepted_child = child
                    break
                if not owned:
                    p, owned = p.clone(), True
                px_raw = float(p[x])
                p[x] = 0.0  # residual of a point mass: p without x
                rest = float(p.sum())
                if rest > 0.0:
                    mass = rest
                else:
                    p[x] = px_raw  # rounding-level rejection: keep p (see module docstring)
            else:
                qx = float(q_cur[x])
                if qx <= 0.0:
                    raise ValueError(f"node {child}: token {x} has draft probability 0")
                if _uniform(generator) < px / qx:
                    accepted_child = child
                    break
                residual = _residual(p / mass, q_cur)  # [V]
                residual_mass = float(residual.sum())
                if residual_mass > 0.0:
                    p, mass, owned = residual, residual_mass, True
                if without_replacement:
                    q_cur = q_cur.clone()
                    q_cur[x] = 0.0
                    q_mass = q_cur.sum()
                    if float(q_mass) > 0.0:
                        q_cur /= q_mass
        if accepted_child is None:
            return AcceptResult(accepted=path, bonus_token=sample_from_probs(p, generator))
        node = accepted_child
        path.append(node)
