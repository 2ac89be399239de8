"""GraphedSampledTree: a sampled tree-speculation step as static-shape device code.

The sampled counterpart of ``GraphedGreedyTree`` (same catch-up rows, MTP forwards, verify,
outputs and rollback, from ``GraphedTreeStep``), for requests that sample (temperature > 0, any
top-k / top-p) without penalties or a seed. Its tree has a *fixed shape*, the optimiser's
(``engine.spec.defaults.sampled_tree_shape``): node ``i`` of the shape is the ``ranks[i]``-th
draw among its parent's children, so how many children a node gets never depends on the values
drawn (the exactness condition of multi-draft rejection sampling, see ``engine.spec.verifier``).

Per step, on the device, with no host reads:

1. Drafting. Depth ``m``'s frontier rows (the shape's depth ``m - 1`` nodes with children) give
   draft distributions ``q`` (MTP logits at the request's temperature / top-k / top-p); each
   node's children are drawn *without replacement* from its ``q`` by an exponential race
   (Gumbel-top-k). A draw whose key is 0 (fewer tokens with mass than children) is invalid and
   never accepted.
2. One tree-masked target forward; ``p`` at every node from the target logits.
3. Recursive rejection sampling down the tree, all sequences at once: at the current node try
   the children in draw order, accept ``x`` with probability ``min(1, p(x) / q(x))``; on
   rejection ``p <- norm(max(p - q, 0))`` and ``q <- q`` without ``x``, renormalised (the law of
   the next draw); if no child is accepted, or the node is a leaf, the bonus token is drawn
   from ``p``. This is ``verify_sampling`` with tensors instead of Python loops; the emitted
   tokens have exactly the target's law.

Randomness comes from the device's default generator (inside a CUDA graph: its Philox stream,
advanced on every replay), so the step serves unseeded requests only; a seeded request takes the
host-driven path, which draws everything from the request's own generator and is reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.host_tensor import copy_to_device
from engine.kv.block_pool import BlockPool
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.draft_layer import DraftLayer
from engine.params import SamplingParams
from engine.sequence import Sequence
from engine.simulator.tree_shape import TreeShape
from engine.spec.device_tree import (
    AcceptedPath,
    StaticTree,
    accept_sampled,
    ancestor_mask,
    race_draw,
)
from engine.spec.drafter import TreeBudget
from engine.spec.graphed_state import BucketBuffers
from engine.spec.graphed_tree import DEFAULT_BUCKETS, GraphedTreeStep


class GraphedSampledTree(GraphedTreeStep):
    """Fixed-shape sampled tree speculation with device-side rejection sampling."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: BlockPool,
        budget: TreeBudget,
        shape: TreeShape,
        max_blocks: int,
        max_batch: int,
        use_graphs: bool,
        reuse_last_module: bool = True,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        draft_layers: dict[int, DraftLayer] | None = None,
    ) -> None:
        k = model.config.num_mtp_modules
        if k < 1 or shape.budget < 1:
            raise ValueError("GraphedSampledTree needs MTP modules and a shape with draft nodes")
        if not reuse_last_module and shape.max_depth > k:
            raise ValueError(f"shape depth {shape.max_depth} needs reuse_last_module with {k} modules")
        depths = shape.depths
        kids = [shape.children(i) for i in range(shape.num_nodes)]
        D = shape.max_depth
        # fronts[m - 1]: nodes whose children are drawn at depth m (parents at depth m - 1).
        fronts = [[i for i in range(shape.num_nodes) if depths[i] == m - 1 and kids[i]]
                  for m in range(1, D + 1)]  # fmt: skip
        super().__init__(model, pool, budget, max_blocks, max_batch, use_graphs, D, shape.budget,
                         [0] + [len(f) for f in fronts[1:]], buckets, draft_layers)  # fmt: skip
        self.shape = shape
        dev = self.device
        self.draws = [max(len(kids[i]) for i in f) for f in fronts]  # [m - 1] children drawn per row
        # Column gathers of the step's tensors, None where one takes every column in order (a
        # chain's: no gather kernel). Depth m's nodes as flat indices into its draws
        # [F_m * draws_m]; the nodes in that order.
        self._drawn_index, order = [], []
        for m, front in enumerate(fronts, start=1):
            flat = [j * self.draws[m - 1] + shape.ranks[c] for j, p in enumerate(front) for c in kids[p]]
            self._drawn_index.append(_columns(flat, len(front) * self.draws[m - 1], dev))
            order += [c for p in front for c in kids[p]]
        self._to_shape_order = _columns(sorted(range(len(order)), key=order.__getitem__), len(order), dev)
        # Next frontier (depth m nodes with children): position among depth m's nodes, and
        # the row of its parent among depth m's frontier rows.
        self._next_front, self._next_parent = [], []
        for m, front in enumerate(fronts[1:], start=1):
            level = [c for p in fronts[m - 1] for c in kids[p]]
            self._next_front.append(_columns([level.index(n) for n in front], len(level), dev))
            self._next_parent.append(_columns([fronts[m - 1].index(shape.parents[n]) for n in front],
                                              len(fronts[m - 1]), dev))  # fmt: skip
        # Tree structure, static; draft-distribution rows in frontier order, depth by depth.
        self.tree = StaticTree.build(shape, [i for f in fronts for i in f], dev)
        self._depths = torch.tensor(depths, device=dev)  # [N+1]
        self._mask = ancestor_mask(torch.tensor([0, *shape.parents[1:]], device=dev)[None], D)[0]
        self._tokens: list[Tensor] = []  # per depth: drawn tokens [B, n_m]
        self._valid: list[Tensor] = []  # per depth: draw had positive key [B, n_m]
        self._q: list[Tensor] = []  # per depth: draft distributions [B, F_m, V]
        self._capture()

    def serves(self, params: SamplingParams) -> bool:
        return not params.greedy and not params.stays_on_host and params.seed is None

    def _load_sampling(self, buf: BucketBuffers, seqs: list[Sequence]) -> None:
        n = len(seqs)
        params = [s.sampling for s in seqs]
        copy_to_device(buf.temperature[:n], torch.tensor([p.temperature for p in params]))
        vocab = self.model.config.vocab_size  # a larger top-k keeps every token, as the vocabulary does
        copy_to_device(buf.top_k[:n], torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int32))
        copy_to_device(buf.top_p[:n], torch.tensor([p.top_p for p in params]))
        self.variant = any(p.top_k > 0 or p.top_p < 1.0 for p in params)

    def _head(self, hidden: Tensor) -> Tensor:  # [B, R, H] -> [B, R, V]
        """Logits of normalised hidden states, as the laws' kernels read them: on the GPU the
        head's own dtype (the law is computed in float32 either way; a cast of the 16-bit
        logits was one more kernel per depth), else ``model.logits``."""
        return self.model.lm_head(hidden) if hidden.is_cuda else self.model.logits(hidden)

    def _filters(self, buf: BucketBuffers) -> tuple[Tensor | None, Tensor | None]:
        """The batch's top-k and top-p per sequence, where some request uses them."""
        return (buf.top_k, buf.top_p) if self.variant else (None, None)

    def _probs(self, buf: BucketBuffers, logits: Tensor) -> Tensor:  # [B, R, V] -> [B, R, V] float32
        B, R, V = logits.shape
        return race_draw(logits.reshape(B * R, V), buf.temperature, R, 0, None, *self._filters(buf))[0].view(B, R, V)

    def _draw(self, buf: BucketBuffers, logits: Tensor, w: int) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's draft law q [B, F, V] and ``w`` children drawn from it without
        replacement by an exponential race: their keys [B, F, w] (0: no mass left) and tokens
        [B, F, w], in draw order. One fused kernel on the GPU (``race_draw``; as torch ops it
        was ~30 kernels a depth with temperature alone, the radix top-k most of them, and a
        sort more with top-k or top-p)."""
        B, F, V = logits.shape
        q, key, drawn = race_draw(logits.reshape(B * F, V), buf.temperature, F, w, None, *self._filters(buf))
        return q.view(B, F, V), key.view(B, F, w), drawn.view(B, F, w)

    def _grow(self, m: int, front_hidden: Tensor, buf: BucketBuffers) -> tuple[Tensor, Tensor]:
        if m == 1:
            self._tokens, self._valid, self._q = [], [], []
        B, H = buf.bucket, self.hidden_size
        q, key, drawn = self._draw(buf, self._head(front_hidden), self.draws[m - 1])  # [B, F, *]
        index = self._drawn_index[m - 1]
        self._tokens.append(_take(drawn.flatten(1), index))  # [B, n_m]
        self._valid.append(_take(key.flatten(1), index) > 0)
        self._q.append(q)
        if m == self.D:
            return self._tokens[-1], front_hidden  # no deeper frontier
        prev = _take(front_hidden, self._next_parent[m - 1])  # [B, F', H] parent rows' outputs
        return _take(self._tokens[-1], self._next_front[m - 1]), prev.reshape(B, -1, H)

    def _tree(self, buf: BucketBuffers) -> tuple[Tensor, Tensor, Tensor]:
        B, n = buf.bucket, self.N + 1
        drafts = _take(torch.cat(self._tokens, 1), self._to_shape_order)  # [B, N] in node order
        tokens = torch.cat([self._root[:, None], drafts], 1)  # [B, N+1]
        return tokens, self._depths.expand(B, n), self._mask.expand(B, n, n)

    def _accept(self, buf: BucketBuffers, tokens: Tensor, hidden: Tensor) -> AcceptedPath:
        valid = torch.cat([torch.ones_like(tokens[:, :1], dtype=torch.bool),
                           _take(torch.cat(self._valid, 1), self._to_shape_order)], 1)  # fmt: skip
        return accept_sampled(
            tokens, valid, self._probs(buf, self._head(hidden)), torch.cat(self._q, 1),
            self.tree,
        )


def _columns(index: list[int], width: int, device: torch.device) -> Tensor | None:
    """``index`` as a device tensor of columns to gather from ``width``, None where it takes
    every column in order."""
    return None if index == list(range(width)) else torch.tensor(index, device=device)


def _take(x: Tensor, columns: Tensor | None) -> Tensor:  # [B, C, ...] -> [B, len(columns), ...]
    return x if columns is None else x[:, columns]
