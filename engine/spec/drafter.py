"""MTPDrafter: catch up the MTP modules' latent KV and draft one tree per sequence.

Terms (one sequence, K = index of the pending token x_K, which the target has not run yet):
- MTP module d (1-based) at hidden index t consumes the depth-(d-1) hidden state at t (depth 0:
  the target's final-normed hidden state) and the embedding of x_{t+d}; its output predicts
  x_{t+d+1}. Its *committed* rows are those whose token x_{t+d} is known: t <= K - d.
- Catch-up: after each target forward, module d runs over its new committed rows, writing its
  own latent KV; the target's hidden states come from the verify pass itself, so no extra target
  forward is needed. Module 1's row at K-1 (token x_K, the root) gives the depth-1 logits.
- Drafting depth m >= 2: module m runs a row at hidden index K-1 for each frontier node n of
  depth m-1 (token n, hidden state of n's parent's row); its output gives n's children.
  Depths beyond the number of modules reuse the last module (``SpecConfig.reuse_last_module``).
- Visibility: module d's row at t sees its own rows at indices <= t - (d - 1) and itself; the
  recent rows it skips would need draft tokens (training uses the same band mask, see
  ``mtp_band_mask``), so drafting computes exactly the trained function.

All rows of one module for all sequences go through one batched forward. Frontier rows are
written to scratch slots after the committed rows and zeroed right after the forward.

Tree policy (EAGLE-2): each depth expands the ``topk`` best frontier nodes (by cumulative draft
log-probability) with ``topk`` children each. Greedy requests take the top-k children and keep
the best ``num_draft_tokens`` nodes of the whole tree; sampling requests draw the children
without replacement from the draft distribution at the request's temperature / top-k / top-p,
and keep the first ``num_draft_tokens`` nodes in creation order, which never depends on a
child's own sampled value (the verifier's exactness condition, see ``engine.spec.tree``).
Seeded sampled requests, whose draws are keyed by position (``engine.keyed_noise``) and which
are verified as greedy ones, take the sampled trees' shape, their children the first arrivals
of the race over the drafter's law with the noise of the target's draw at their position.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.batch_builder import SeqRows, build_batch
from engine.keyed_noise import keyed_exponentials
from engine.kv.block_pool import BlockPool
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM, mtp_band_mask
from engine.sampling import probs_from_logits, sample_without_replacement
from engine.sequence import Sequence
from engine.simulator.tree_shape import TreeShape
from engine.spec.tree import DraftTree, select_best_nodes

if TYPE_CHECKING:
    from engine.spec.graphed_catch_up import GraphedCatchUp

CATCH_UP_SLACK = 2  # extra catch-up rows: an AR step or two between speculative steps is fine
_CACHED_MASK_ROWS = 32  # masks of at most this many rows are kept (a step's rows, not a prompt's)


def _build_rows_mask(n_catch: int, depth: int, n_front: int) -> torch.Tensor:
    n = n_catch + n_front
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:n_catch, :n_catch] = mtp_band_mask(n_catch, depth)
    mask[n_catch:, :n_catch] = True
    mask[n_catch:, n_catch:] = torch.eye(n_front, dtype=torch.bool)
    return mask


_cached_rows_mask = functools.lru_cache(maxsize=256)(_build_rows_mask)


def _rows_mask(n_catch: int, depth: int, n_front: int) -> torch.Tensor:
    """[n, n] bool among module ``depth``'s new rows (n = n_catch + n_front; read-only, shared):
    catch-up rows see each other within the training band (``mtp_band_mask``), frontier rows
    every catch-up row and themselves."""
    if n_catch + n_front <= _CACHED_MASK_ROWS:
        return _cached_rows_mask(n_catch, depth, n_front)
    return _build_rows_mask(n_catch, depth, n_front)


def _keyed_arrivals(q: torch.Tensor, noise: torch.Tensor, k: int) -> list[int]:
    """A seeded sampled request's children of one node: the first ``k`` arrivals (those with
    mass) of the race over the drafter's law ``q`` [V] with ``noise`` [V], that of the target's
    keyed draw at the children's position (``engine.keyed_noise``). Where the two laws agree the
    first arrival is the target's token (Gumbel-max coupling); whatever they are, the verifier
    emits the target's draws, so they need no law of their own (no ``child_q``)."""
    values, tokens = (q / noise).topk(min(k, q.shape[0]))  # [k] x2, arrival order
    return [t for t, v in zip(tokens.tolist(), values.tolist(), strict=True) if v > 0]


def _children_of(shape: TreeShape) -> list[list[int]]:
    """For each shape node, its children ordered by sibling rank."""
    kids: list[list[int]] = [[] for _ in shape.parents]
    for node, parent in enumerate(shape.parents):
        if parent >= 0:
            kids[parent].append(node)
    for k in kids:
        k.sort(key=lambda c: shape.ranks[c])
    return kids


@dataclass(frozen=True)
class TreeBudget:
    """Shape limits of one step's trees (root excluded)."""

    topk: int
    depth: int
    num_draft_tokens: int
    min_path_prob: float = 0.0  # greedy trees: stop deepening below this path probability

    def __post_init__(self) -> None:
        # Hashed once: adaptive speculation keys its per-arm tables by budget, several lookups
        # per step (the generated hash re-hashed the fields each time: ~5 us of a step's host
        # work on a 2-core host, where batch 256's autoregressive steps are host-bound).
        object.__setattr__(self, "_hash", hash((self.topk, self.depth, self.num_draft_tokens, self.min_path_prob)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    @property
    def speculates(self) -> bool:
        return self.num_draft_tokens > 0 and self.depth > 0


def steady_catch_up_rows(depth: int) -> int:
    """Rows module 1 may be behind after a speculative step of ``depth`` draft depths: its
    accepted path (at most ``depth + 1`` tokens) and ``CATCH_UP_SLACK``. The graphed step
    catches up that many in-graph; adaptive speculation counts rows beyond it as a lag."""
    return depth + 1 + CATCH_UP_SLACK


@dataclass
class _Node:
    token: int
    parent: int  # index in the node list, -1 for the root
    depth: int
    score: float  # cumulative draft log-probability
    hidden: torch.Tensor | None = None  # output of the row fed with this node's token
    shape_index: int = 0  # sampled trees: the node of the planned shape this node fills


@dataclass
class _SeqDraft:
    seq: Sequence
    nodes: list[_Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)
    child_q: dict[int, torch.Tensor] = field(default_factory=dict)


class MTPDrafter:
    _shape_children: list[list[int]] | None = None

    def __init__(
        self, model: DeepseekV3ForCausalLM, pool: BlockPool, reuse_last_module: bool
    ) -> None:
        self.model = model
        self.pool = pool
        self.num_modules = model.config.num_mtp_modules
        self.reuse_last_module = reuse_last_module
        self.device = pool.kv_cache.device
        # Static shapes / CUDA graphs for catching up many rows (set by the engine when it
        # runs static paths); None: eager forwards.
        self.static_catch_up: GraphedCatchUp | None = None

    # ---- catch-up + drafting ----
    def draft(
        self, seqs: list[Sequence], budget: TreeBudget, sampled_shape: TreeShape | None = None
    ) -> list[DraftTree]:
        """Catch up the MTP caches and draft one tree per sequence.

        ``sampled_shape`` fixes how many children each node of a *sampled* tree gets, by its
        position in the shape (sibling ranks = draw order), never by the drawn values; None
        falls back to expanding the ``topk`` best frontier nodes with ``topk`` children each.
        """
        self._shape_children = _children_of(sampled_shape) if sampled_shape is not None else None
        max_depth = budget.depth
        if not self.reuse_last_module:
            max_depth = min(max_depth, self.num_modules)
        drafts = [
            _SeqDraft(seq, nodes=[_Node(seq.tokens[-1], -1, 0, 0.0)], frontier=[0]) for seq in seqs
        ]
        for m in range(1, max_depth + 1):
            module = min(m, self.num_modules)
            rows: list[SeqRows] = []
            owners: list[Sequence] = []
            starts: list[int] = []
            catch_counts: list[int] = []
            frontier_nodes: list[list[int]] = []
            for d in drafts:
                seq = d.seq
                k_idx = len(seq.tokens) - 1
                spec = self._catch_up_rows(seq, m) if m <= self.num_modules else None
                if spec is None:
                    ctx = seq.mtp_committed[module - 1]
                    spec = (SeqRows(seq.block_ids, ctx, [], [], _rows_mask(0, m, 0)), ctx, 0)
                base, start, n_catch = spec
                front = d.frontier if m >= 2 else []
                base = self._add_frontier_rows(base, d, front, k_idx, m)
                rows.append(base)
                owners.append(seq)
                starts.append(start)
                catch_counts.append(n_catch)
                frontier_nodes.append(front)
            frontier_hidden = self._run_module(
                module,
                rows,
                owners,
                starts,
                catch_counts,
                frontier_nodes,
            )
            self._expand(drafts, frontier_hidden, m, budget)
            if not any(d.frontier for d in drafts):
                break
        return [self._finish_tree(d, budget) for d in drafts]

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Catch every module up to all but its newest committed row (after a prefill, or after
        autoregressive steps).

        That leaves each sequence in the state a speculative step leaves behind (one row to go
        per module), so its next decode step can take the graphed path
        (``engine.spec.graphed_tree``). With ``static_catch_up`` the rows go through its
        captured shapes: all modules in one fused replay where a sequence's rows fit one pass,
        else a replay per module and pass (several passes for rows beyond its largest shape);
        without, one eager forward per module.
        """
        static = self.static_catch_up
        if static is None:
            for depth in range(1, self.num_modules + 1):
                specs = [(seq, self._catch_up_rows(seq, depth, keep=1)) for seq in seqs]
                ready = [(seq, spec) for seq, spec in specs if spec is not None]
                if ready:
                    self._run_module(depth, [spec[0] for _, spec in ready], [seq for seq, _ in ready],
                                     [spec[1] for _, spec in ready], [spec[2] for _, spec in ready],
                                     [[] for _ in ready])  # fmt: skip
            return
        seqs = static.catch_up(seqs)  # the sequences its fused replays do not cover
        for depth in range(1, self.num_modules + 1):
            while seqs:  # passes of at most ``max_rows`` rows per sequence
                pending = [(seq, self._pending_rows(seq, depth, 1, static.max_rows)) for seq in seqs]
                work = [(seq, start, prev) for seq, (start, prev) in pending if prev is not None]
                if not work:
                    break
                for (seq, start, prev), out in zip(work, static.run(depth, work), strict=True):
                    seq.mtp_committed[depth - 1] += prev.shape[0]
                    if out is not None:
                        seq.push_hidden(depth, start, out)

    # ---- row construction ----
    def _pending_rows(
        self, seq: Sequence, depth: int, keep: int = 0, limit: int | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """Take module ``depth``'s committed rows not yet computed, but the newest ``keep``, at
        most ``limit`` of them: (first hidden index, their depth-``depth - 1`` inputs [n, H] or
        None). The first index is the module's committed count."""
        ctx = seq.mtp_committed[depth - 1]
        upto = len(seq.tokens) - 1 - depth - keep
        if limit is not None:
            upto = min(upto, ctx + limit - 1)
        start, prev = seq.take_hidden(depth - 1, upto=upto)
        if prev is None or prev.shape[0] == 0:
            return start, None
        assert start == ctx, f"module {depth}: hidden rows start at {start}, committed {ctx}"
        return start, prev

    def _catch_up_rows(self, seq: Sequence, depth: int, keep: int = 0) -> tuple[SeqRows, int, int] | None:
        """Module ``depth``'s pending rows (``_pending_rows``) as a forward's rows:
        (rows, first index, count)."""
        start, prev = self._pending_rows(seq, depth, keep)
        if prev is None:
            return None
        ctx, n = start, prev.shape[0]
        hidden_idx = list(range(start, start + n))
        tokens = [seq.tokens[t + depth] for t in hidden_idx]
        positions = [t + depth for t in hidden_idx]
        mask = _rows_mask(n, depth, 0)
        query_ctx = [min(ctx, t - depth + 2) for t in hidden_idx]
        rows = SeqRows(seq.block_ids, ctx, tokens, positions, mask, query_ctx)
        rows.prev_hidden = prev
        return rows, start, n

    def _add_frontier_rows(
        self, base: SeqRows, d: _SeqDraft, front: list[int], k_idx: int, m: int
    ) -> SeqRows:
        n_catch = len(base.token_ids)
        if not front:
            return base
        mask = _rows_mask(n_catch, m, len(front))
        tokens = base.token_ids + [d.nodes[i].token for i in front]
        positions = base.positions + [k_idx + m - 1] * len(front)
        query_ctx = (base.query_ctx_lens or []) + [base.ctx_len] * len(front)
        parents_hidden = [d.nodes[d.nodes[i].parent].hidden for i in front]
        stacked = torch.stack([h for h in parents_hidden if h is not None])
        prev = stacked if base.prev_hidden is None else torch.cat([base.prev_hidden, stacked])
        return SeqRows(base.block_ids, base.ctx_len, tokens, positions, mask, query_ctx, prev)

    # ---- forward of one module over all sequences ----
    def _run_module(
        self,
        module: int,
        rows: list[SeqRows],
        owners: list[Sequence],
        starts: list[int],
        catch_counts: list[int],
        frontier_nodes: list[list[int]],
    ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Run module ``module``; commit catch-up rows; return per sequence
        (hidden of its row at K-1 for depth 1 else None, frontier hidden [f, H] or None)."""
        out: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        active = [r for r in rows if r.token_ids]
        if not active:
            return [(None, None) for _ in rows]
        ids, batch = build_batch(active, self.pool.block_size, self.device)
        prevs = [r.prev_hidden for r in active if r.prev_hidden is not None]
        prev = prevs[0] if len(prevs) == 1 else torch.cat(prevs)  # [N, H]
        cache_layer = self.model.mtp_cache_layer(module)
        hidden = self.model.forward_mtp(module, prev, ids, batch, self.pool.kv_cache)
        offset = 0
        scratch: list[torch.Tensor] = []
        for seq, r, start, n_catch, front in zip(
            owners, rows, starts, catch_counts, frontier_nodes, strict=True
        ):
            n = len(r.token_ids)
            if n == 0:
                out.append((None, None))
                continue
            h = hidden[offset : offset + n]
            if n_catch:
                seq.mtp_committed[module - 1] += n_catch
                seq.push_hidden(module, start, h[:n_catch])
            last_row = (
                h[n_catch - 1] if (n_catch and start + n_catch - 1 == len(seq.tokens) - 2) else None
            )
            out.append((last_row, h[n_catch:] if front else None))
            if front:
                scratch.append(batch.slot_mapping[offset + n_catch : offset + n])
            offset += n
        if scratch:  # frontier rows were drafts: no remanence in the MTP cache
            self.pool.zero_slots(torch.cat(scratch), slice(cache_layer, cache_layer + 1))
        return out

    # ---- tree growth ----
    def _expand(
        self,
        drafts: list[_SeqDraft],
        results: list[tuple[torch.Tensor | None, torch.Tensor | None]],
        m: int,
        budget: TreeBudget,
    ) -> None:
        """Turn each frontier row's hidden state into children at depth m."""
        parents_per_seq: list[list[int]] = []
        hiddens: list[torch.Tensor] = []
        for d, (root_hidden, front_hidden) in zip(drafts, results, strict=True):
            if m == 1:
                if root_hidden is None:
                    parents_per_seq.append([])
                    continue
                d.nodes[0].hidden = root_hidden
                parents_per_seq.append([0])
                hiddens.append(root_hidden[None])
            else:
                front = d.frontier
                if front_hidden is not None:
                    for i, node_idx in enumerate(front):
                        d.nodes[node_idx].hidden = front_hidden[i]
                    hiddens.append(front_hidden)
                parents_per_seq.append(front if front_hidden is not None else [])
        if not hiddens:
            for d in drafts:
                d.frontier = []
            return
        logits = self.model.logits(hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens))  # [rows, V]
        topk = min(budget.topk, logits.shape[-1])
        # Greedy rows: top-k of every row at once, one transfer to the host.
        top_values, top_tokens = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)  # [rows, k]
        top_pairs = list(zip(top_tokens.tolist(), top_values.tolist(), strict=True))
        row = 0
        for d, parents in zip(drafts, parents_per_seq, strict=True):
            new_nodes: list[int] = []
            params = d.seq.sampling
            noise: torch.Tensor | None = None  # a seeded request's keyed noise at this depth [V]
            for parent in parents:
                row_tokens, row_values = top_pairs[row]
                row += 1
                if params.greedy:
                    picks = list(zip(row_tokens, row_values, strict=True))
                else:
                    q = probs_from_logits(
                        logits[row - 1 : row],
                        torch.tensor([params.temperature]),
                        torch.tensor([params.top_k]),
                        torch.tensor([params.top_p]),
                    )[0]
                    shape_kids = self._planned_children(d.nodes[parent].shape_index, topk)
                    if not shape_kids:
                        continue
                    if params.keyed and params.seed is not None:
                        if noise is None:  # one position for every node of this depth
                            lands_at = len(d.seq.tokens) - 1 + m
                            noise = keyed_exponentials([params.seed], [lands_at], q.shape[0], q.device)[0]  # [V]
                        drawn = _keyed_arrivals(q, noise, len(shape_kids))
                    else:
                        d.child_q[parent] = q
                        drawn = sample_without_replacement(q, len(shape_kids), d.seq.generator)
                    picks = [(t, float(torch.log(q[t]))) for t in drawn]
                for i, (token, logp) in enumerate(picks):
                    node = _Node(token, parent, m, d.nodes[parent].score + logp)
                    if not params.greedy:
                        node.shape_index = shape_kids[i]
                    d.nodes.append(node)
                    new_nodes.append(len(d.nodes) - 1)
            if params.greedy or self._shape_children is None:
                # The best `topk` new nodes (depends only on the nodes' own values).
                new_nodes.sort(key=lambda i: -d.nodes[i].score)
                d.frontier = sorted(new_nodes[: budget.topk])
            else:
                # Planned shape: expand exactly the nodes the shape gives children.
                d.frontier = [i for i in new_nodes if self._shape_children[d.nodes[i].shape_index]]
            if not params.greedy and len(d.nodes) - 1 >= budget.num_draft_tokens:
                d.frontier = []  # creation order already fills the budget
            if params.greedy and d.frontier and budget.min_path_prob > 0:
                # EAGLE-2's confidence: stop drafting deeper once even the best path is unlikely
                # (saves sequential MTP forwards where the target would reject anyway).
                best = max(d.nodes[i].score for i in d.frontier)
                if best < math.log(budget.min_path_prob):
                    d.frontier = []

    def _planned_children(self, shape_index: int, topk: int) -> list[int]:
        """Shape nodes filled by the children of a sampled node (in draw order)."""
        if self._shape_children is None:
            return list(range(topk))  # unplanned: topk children, shape indices unused
        return self._shape_children[shape_index]

    def _finish_tree(self, d: _SeqDraft, budget: TreeBudget) -> DraftTree:
        cands = d.nodes[1:]
        root_token = d.nodes[0].token
        if not cands:
            return DraftTree([root_token], [-1])
        if d.seq.sampling.greedy:
            parents = torch.tensor([n.parent - 1 for n in cands])  # candidate index space
            scores = torch.tensor([n.score for n in cands], dtype=torch.float64)
            keep = select_best_nodes(scores, parents, budget.num_draft_tokens)
            return DraftTree.from_candidates(root_token, [n.token for n in cands], parents, keep)
        # Sampling: the first num_draft_tokens nodes in creation order (ancestor-closed).
        count = min(budget.num_draft_tokens, len(cands)) + 1
        tokens = [n.token for n in d.nodes[:count]]
        parents_list = [n.parent for n in d.nodes[:count]]
        child_q = [
            d.child_q.get(i) if any(p == i for p in parents_list) else None for i in range(count)
        ]
        wor = [q is not None for q in child_q]
        return DraftTree(
            tokens, parents_list, child_q=child_q, child_sampled_without_replacement=wor
        )
