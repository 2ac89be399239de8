"""The host-driven speculative step: draft -> one tree-masked target forward -> accept -> compact.

The reference path of speculative decoding, and the one that serves what no device-resident
step (``engine.spec.graphed_tree``) takes: eager engines (the CPU's default), requests with
penalties, budgets without a captured step. Each sequence's tree is drafted by the MTP modules
(``MTPDrafter.draft``), all trees are verified in one target forward under their tree masks,
each is accepted on the host (``verify_greedy`` / ``verify_sampling``: lossless; a seeded
sampled request greedily against its keyed draws, ``engine.keyed_noise``), and one fused
call moves the accepted path's target KV down and zeroes the rejected slots
(``compact_and_zero``). The engine appends the emitted tokens (``LLMEngine._append_tokens``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.batch_builder import SeqRows, build_batch
from engine.keyed_noise import keyed_tokens
from engine.kv.block_pool import BlockPool
from engine.kv.compaction import compact_and_zero
from engine.logprobs import TokenLogprob, token_logprobs
from engine.model.attention_batch import AttentionBatch
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.outputs import StepTimings
from engine.sampling import (
    apply_logit_bias,
    apply_penalties,
    ban_tokens,
    probs_from_logits,
    token_counts,
)
from engine.sequence import Sequence
from engine.simulator.tree_shape import TreeShape
from engine.spec.acceptance_stats import AcceptanceCounter
from engine.spec.defaults import LIVE_STATS_MIN_STEPS, sampled_tree_shape
from engine.spec.drafter import MTPDrafter, TreeBudget
from engine.spec.tree import DraftTree
from engine.spec.verifier import AcceptResult, verify_greedy, verify_sampling

# The target's decode forward: (token ids [N], their batch, new tokens of every sequence when
# they are all equal, else None) -> hidden states [N, H] (``LLMEngine._forward_target``).
TargetForward = Callable[[torch.Tensor, AttentionBatch, "int | None"], torch.Tensor]


class Verified(NamedTuple):
    """One sequence's tree, what its verification accepted, and (where its sampling asks for
    them) the emitted tokens' log-probabilities, off the target's rows of the accepted path."""

    tree: DraftTree
    result: AcceptResult
    logprobs: list[TokenLogprob] | None = None

    @property
    def new_tokens(self) -> list[int]:
        """The accepted draft tokens, then the bonus token."""
        return [self.tree.token_list[a] for a in self.result.accepted[1:]] + [self.result.bonus_token]


class HostTreeStep:
    """Speculative steps driven from the host over the engine's model, KV pool and drafter;
    ``forward``: the target's decode forward (static shapes where they fit, else eager)."""

    def __init__(
        self, model: DeepseekV3ForCausalLM, pool: BlockPool, drafter: MTPDrafter, forward: TargetForward
    ) -> None:
        self.model = model
        self.pool = pool
        self.drafter = drafter
        self.forward = forward
        self.device = pool.kv_cache.device
        # The sampled trees' planned shape, keyed by (budget, live statistics' generation).
        self._shape_cache: tuple[tuple[TreeBudget, int], TreeShape] | None = None

    def run(
        self, seqs: list[Sequence], budget: TreeBudget, sampled_acceptance: AcceptanceCounter
    ) -> tuple[list[Verified], StepTimings]:
        """One speculative step of ``budget`` over ``seqs`` (their MTP modules caught up to a
        steady step's lag): each sequence's verified tree, its accepted rows committed (KV
        compacted, hidden rows queued for the MTP modules), and the step's timings.
        ``sampled_acceptance``: the sampled trees' statistics, which plan their shape."""
        t0 = time.perf_counter()
        trees = self.drafter.draft(seqs, budget, self._sampled_shape(budget, seqs, sampled_acceptance))
        t1 = time.perf_counter()
        rows = [
            SeqRows(
                seq.block_ids,
                seq.num_committed,
                tree.token_list,
                [seq.num_committed + d for d in tree.depth_list],
                tree.tree_mask(),
            )
            for seq, tree in zip(seqs, trees, strict=True)
        ]
        ids, batch = build_batch(rows, self.pool.block_size, self.device)
        sizes = {tree.num_nodes for tree in trees}
        hidden = self.forward(ids, batch, sizes.pop() if len(sizes) == 1 else None)  # [N, H]
        logits = self.model.logits(hidden)  # [N, V]
        t2 = time.perf_counter()
        offset = 0
        verified: list[Verified] = []
        src: list[torch.Tensor] = []  # [*] flat slots of accepted nodes off their path position
        dst: list[torch.Tensor] = []  # [*] the path positions they move to
        zero: list[torch.Tensor] = []  # [*] slots past the accepted path
        for seq, tree in zip(seqs, trees, strict=True):
            n = tree.num_nodes
            result = self._verify(seq, tree, logits[offset : offset + n])
            path = torch.tensor(result.accepted, device=self.device)  # [m + 1] node indices
            step = Verified(tree, result)
            if seq.sampling.logprobs is not None:  # node a's row predicts the token after a
                lp = token_logprobs(logits[offset : offset + n][path], step.new_tokens, seq.sampling.logprobs)
                step = step._replace(logprobs=lp)
            verified.append(step)
            slots = batch.slot_mapping[offset : offset + n]  # [n] flat slots of the tree
            m = len(result.accepted) - 1
            if any(a != i for i, a in enumerate(result.accepted)):
                src.append(slots[path])
                dst.append(slots[: m + 1])
            zero.append(slots[m + 1 :])
            seq.push_hidden(0, seq.num_committed, hidden[offset : offset + n][path])
            seq.num_committed += m + 1
            offset += n
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        r0 = time.perf_counter()
        self._compact(src, dst, zero)
        rollback = time.perf_counter() - r0
        if events is not None:
            events[1].record()
        return verified, StepTimings(t1 - t0, t2 - t1, rollback, events)

    def _sampled_shape(
        self, budget: TreeBudget, seqs: list[Sequence], sampled_acceptance: AcceptanceCounter
    ) -> TreeShape | None:
        """Planned shape for sampled trees, re-planned as live statistics accumulate."""
        if all(seq.sampling.greedy for seq in seqs):
            return None
        steps = sampled_acceptance.num_steps
        key = (budget, steps // 256 if steps >= LIVE_STATS_MIN_STEPS else -1)
        if self._shape_cache is None or self._shape_cache[0] != key:
            snapshot = sampled_acceptance.snapshot() if key[1] >= 0 else None
            self._shape_cache = (key, sampled_tree_shape(budget, snapshot))
        return self._shape_cache[1]

    def _verify(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        """Accept a path of ``tree`` against the target's logits [n, V] at its nodes, under
        ``seq``'s sampling rule (penalties counted along each node's path, the logit bias
        added, the ends of the output banned where a node's token would come before
        ``min_tokens``)."""
        params = seq.sampling
        if params.has_penalties:
            base = token_counts([seq.output_ids], logits.shape[-1], logits.device)[0]  # [V]
            counts = tree.path_token_counts(base)  # [n, V]
            pres = torch.full((tree.num_nodes,), float(params.presence_penalty))
            freq = torch.full((tree.num_nodes,), float(params.frequency_penalty))
            logits = apply_penalties(logits, counts, pres, freq)
        if params.logit_bias:
            logits = apply_logit_bias(logits, params.logit_bias)
        made = seq.num_output_tokens
        if seq.ends and made < params.min_tokens:  # node a's row draws output made + depth(a) + 1
            early = [i for i, d in enumerate(tree.depth_list) if made + d < params.min_tokens]
            logits = ban_tokens(logits, early, seq.ends)
        if params.greedy:
            return verify_greedy(tree, logits.argmax(dim=-1))
        n = tree.num_nodes
        probs = probs_from_logits(
            logits,
            torch.full((n,), float(params.temperature)),
            torch.full((n,), int(params.top_k), dtype=torch.long),
            torch.full((n,), float(params.top_p)),
        )  # [n, V]
        if params.keyed and params.seed is not None:
            # Node a's row draws the token at position num_committed + depth(a) + 1: its keyed
            # draw is the token autoregressive decoding would take there, so the check is greedy.
            lands_at = [seq.num_committed + d + 1 for d in tree.depth_list]
            return verify_greedy(tree, torch.tensor(keyed_tokens(probs, params.seed, lands_at)))
        return verify_sampling(tree, probs, seq.generator)

    def _compact(self, src: list[torch.Tensor], dst: list[torch.Tensor], zero: list[torch.Tensor]) -> None:
        """One fused call for the batch: move accepted target KV down, zero rejected slots."""
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        main_layers = self.pool.kv_cache[: self.model.config.num_hidden_layers]
        compact_and_zero(
            main_layers,
            torch.cat(src) if src else empty,
            torch.cat(dst) if dst else empty,
            torch.cat(zero) if zero else empty,
        )
