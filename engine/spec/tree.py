"""The draft tree of one sequence, its attention mask, and the EAGLE-2 budget selection.

Node 0 is the root: the pending token, already chosen by the target and not yet run through it.
Every other node is a drafted token. Nodes are stored parents-before-children
(``parents[i] < i``), so index order is a valid processing order and the verify forward writes
node ``i`` to cache slot ``ctx + i`` at RoPE position ``ctx + depth(i)`` (docs/internals.md).

Children of a node are kept in *sibling order*, the order the verifier tries them. For each node
with children the tree records how they were drafted, because exact acceptance depends on it:

- ``child_q[i] is None``: chosen deterministically (top-k / argmax of the drafter). For the
  verifier each such child is a point mass; *any* rule for choosing them (including EAGLE-2's
  budget selection below) keeps sampling exact, as long as it does not look at the verifier's
  randomness.
- ``child_q[i] = q`` (``[V]``): the children were sampled from ``q``, i.i.d. or, when
  ``child_sampled_without_replacement[i]``, without replacement in draw order. Exactness then
  needs the children to be exactly those draws: do not drop, reorder or add sampled children
  based on their values (dropping a *suffix* of a without-replacement draw order is fine, and so
  is dropping all children of a node). In particular ``select_best_nodes`` must only prune
  deterministic children.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class DraftTree:
    """Tokens, parents and depths of one sequence's draft tree, root at index 0."""

    def __init__(
        self,
        tokens: Sequence[int] | Tensor,  # [N] root token first
        parents: Sequence[int] | Tensor,  # [N] -1 for the root, parents[i] < i
        child_q: Sequence[Tensor | None] | None = None,  # N entries, each [V] or None
        child_sampled_without_replacement: Sequence[bool] | None = None,  # [N]
    ) -> None:
        token_list = [int(t) for t in (tokens.tolist() if isinstance(tokens, Tensor) else tokens)]
        parent_list = [
            int(p) for p in (parents.tolist() if isinstance(parents, Tensor) else parents)
        ]
        n = len(token_list)
        if n == 0:
            raise ValueError("a draft tree needs at least the root")
        if len(parent_list) != n:
            raise ValueError(f"{len(parent_list)} parents for {n} tokens")
        if parent_list[0] != -1:
            raise ValueError(f"the root's parent must be -1, got {parent_list[0]}")
        if any(t < 0 for t in token_list):
            raise ValueError("token ids must be non-negative")
        depth_list = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            p = parent_list[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must satisfy 0 <= p < i")
            depth_list[i] = depth_list[p] + 1
            children[p].append(i)

        qs: list[Tensor | None] = list(child_q) if child_q is not None else [None] * n
        wor = (
            [bool(w) for w in child_sampled_without_replacement]
            if child_sampled_without_replacement is not None
            else [False] * n
        )
        if len(qs) != n or len(wor) != n:
            raise ValueError(f"child_q and child_sampled_without_replacement need {n} entries")
        for i in range(n):
            q = qs[i]
            if q is not None and q.dim() != 1:
                raise ValueError(f"child_q[{i}] must be 1-D [V], got {tuple(q.shape)}")
            if wor[i] and q is None:
                raise ValueError(f"node {i}: without replacement needs the draft q")
            if wor[i]:
                sibling_tokens = [token_list[c] for c in children[i]]
                if len(set(sibling_tokens)) != len(sibling_tokens):
                    raise ValueError(f"node {i}: children drawn without replacement repeat")

        self.tokens = torch.tensor(token_list, dtype=torch.int64)  # [N]
        self.parents = torch.tensor(parent_list, dtype=torch.int64)  # [N]
        self.depths = torch.tensor(depth_list, dtype=torch.int64)  # [N]
        self.child_q = qs
        self.child_sampled_without_replacement = wor
        self.token_list = token_list
        self.parent_list = parent_list
        self.depth_list = depth_list
        self._children = children
        self._mask: Tensor | None = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_chain(
        cls, tokens: Sequence[int] | Tensor, child_q: Sequence[Tensor | None] | None = None
    ) -> DraftTree:
        """A chain ``tokens[0]`` (root) → ``tokens[1]`` → …; ``child_q[i]`` drew ``tokens[i+1]``."""
        n = len(tokens)
        qs: list[Tensor | None] = [None] * n
        if child_q is not None:
            if len(child_q) not in (n - 1, n):
                raise ValueError(f"child_q needs {n - 1} entries for a chain of {n} tokens")
            qs[: len(child_q)] = list(child_q)
        return cls(tokens, [i - 1 for i in range(n)], child_q=qs)

    @classmethod
    def from_candidates(
        cls,
        root_token: int,
        cand_tokens: Sequence[int] | Tensor,  # [M]
        cand_parents: Sequence[int] | Tensor,  # [M] -1 = child of the root, else < own index
        selected: Sequence[int] | Tensor,  # [K] ascending candidate indices, ancestor-closed
    ) -> DraftTree:
        """The deterministic tree made of ``root_token`` and the selected candidates.

        Node ``k + 1`` is candidate ``selected[k]``; sibling order is candidate index order.
        """
        toks = cand_tokens.tolist() if isinstance(cand_tokens, Tensor) else list(cand_tokens)
        pars = cand_parents.tolist() if isinstance(cand_parents, Tensor) else list(cand_parents)
        sel = [int(s) for s in (selected.tolist() if isinstance(selected, Tensor) else selected)]
        if sel != sorted(set(sel)):
            raise ValueError("selected candidates must be strictly ascending")
        new_index = {c: k + 1 for k, c in enumerate(sel)}
        parents = [-1]
        for c in sel:
            p = int(pars[c])
            if p != -1 and p not in new_index:
                raise ValueError(f"candidate {c} is selected without its parent {p}")
            parents.append(0 if p == -1 else new_index[p])
        return cls([int(root_token)] + [int(toks[c]) for c in sel], parents)

    # -- structure ----------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.token_list)

    def __len__(self) -> int:
        return len(self.token_list)

    def children(self, i: int) -> list[int]:
        """Children of node ``i`` in sibling order (the order the verifier tries them)."""
        return list(self._children[i])

    def sibling_rank(self, i: int) -> int:
        """0 for a first child, 1 for the second, …; 0 for the root."""
        p = self.parent_list[i]
        return 0 if p < 0 else self._children[p].index(i)

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root to ``i`` inclusive."""
        path = [i]
        while self.parent_list[path[-1]] >= 0:
            path.append(self.parent_list[path[-1]])
        return path[::-1]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parent_list))

    # -- tensors for the verify forward -------------------------------------------------------

    def tree_mask(self, device: torch.device | str | None = None) -> Tensor:
        """``[N, N]`` bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or an ancestor of ``i``."""
        if self._mask is None:
            n = self.num_nodes
            if self.is_chain():
                self._mask = torch.ones(n, n, dtype=torch.bool).tril_()  # [N, N] causal
            else:
                ancestors: list[list[int]] = []
                for i, p in enumerate(self.parent_list):
                    ancestors.append((ancestors[p] if p >= 0 else []) + [i])
                rows = [i for i, anc in enumerate(ancestors) for _ in anc]
                cols = [j for anc in ancestors for j in anc]
                mask = torch.zeros(n, n, dtype=torch.bool)  # [N, N]
                mask[torch.tensor(rows), torch.tensor(cols)] = True
                self._mask = mask
        return self._mask if device is None else self._mask.to(device)

    def positions(self, ctx_len: int, device: torch.device | str | None = None) -> Tensor:
        """RoPE positions ``[N]`` int64: ``ctx_len + depth``."""
        pos = self.depths + int(ctx_len)  # [N]
        return pos if device is None else pos.to(device)

    def path_token_counts(self, base_counts: Tensor) -> Tensor:
        """Per-node token counts ``[N, V]`` for the penalties of the token *after* each node.

        ``base_counts`` ``[V]`` counts the generated tokens up to and including the root; node
        ``i`` adds the drafted tokens on its path (root excluded, ``i`` included).
        """
        n = self.num_nodes
        counts = base_counts.expand(n, -1).clone()  # [N, V]
        mask = self.tree_mask().clone()  # [N, N]
        mask[:, 0] = False
        rows, cols = mask.nonzero(as_tuple=True)  # [P] x2 (node, drafted ancestor-or-self)
        if rows.numel():
            dev = counts.device
            toks = self.tokens[cols].to(dev)  # [P]
            counts.index_put_(
                (rows.to(dev), toks), torch.ones_like(toks, dtype=counts.dtype), accumulate=True
            )
        return counts


def select_best_nodes(
    cum_logprob: Tensor,  # [M] cumulative draft log-probability of each candidate
    parents: Tensor,  # [M] int, -1 = child of the root, else a candidate index < own index
    budget: int,
) -> Tensor:  # [K] int64 ascending candidate indices, K = min(budget, M)
    """EAGLE-2 reranking: keep the ``budget`` candidates with the best cumulative log-probability.

    The result is closed under ancestors: a score is first capped by its parent's (so a child
    never outranks its parent even if the caller's scores are not monotone) and ties go to the
    lower index, which is the parent. Returned ascending, which is parent-before-child order;
    feed it to ``DraftTree.from_candidates``. Only valid for deterministic (top-k) children: see
    the module docstring.
    """
    scores = cum_logprob.detach().to("cpu", torch.float64).tolist()
    pars = [int(p) for p in parents.tolist()]
    m = len(scores)
    if len(pars) != m:
        raise ValueError(f"{len(pars)} parents for {m} candidates")
    if budget < 0:
        raise ValueError(f"budget must be non-negative, got {budget}")
    capped: list[float] = []
    for i, (s, p) in enumerate(zip(scores, pars, strict=True)):
        if not -1 <= p < i:
            raise ValueError(f"candidate {i} has parent {p}; parents must satisfy -1 <= p < i")
        s = s if s == s else float("-inf")  # NaN ranks last
        capped.append(s if p < 0 else min(s, capped[p]))
    order = sorted(range(m), key=lambda i: (-capped[i], i))
    return torch.tensor(sorted(order[:budget]), dtype=torch.int64)


def batch_tree_masks(
    trees: Sequence[DraftTree], device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """``new_mask`` ``[sum N_b, max N_b]`` bool and ``query_start`` ``[B + 1]`` int32.

    The format of ``paged_mla_attention``: row ``query_start[b] + i`` is node ``i`` of sequence
    ``b``; column ``j`` is new token ``j`` of the same sequence (cache slot ``ctx_b + j``);
    columns past ``N_b`` are False. A prefill chunk is ``DraftTree.from_chain`` (causal mask),
    an autoregressive step a root-only tree.
    """
    sizes = [t.num_nodes for t in trees]
    total, width = sum(sizes), max(sizes, default=0)
    new_mask = torch.zeros(total, width, dtype=torch.bool)  # [sum N, max N]
    query_start = torch.zeros(len(trees) + 1, dtype=torch.int32)  # [B + 1]
    row = 0
    for b, tree in enumerate(trees):
        n = sizes[b]
        new_mask[row : row + n, :n] = tree.tree_mask()
        row += n
        query_start[b + 1] = row
    if device is not None:
        new_mask, query_start = new_mask.to(device), query_start.to(device)
    return new_mask, query_start
