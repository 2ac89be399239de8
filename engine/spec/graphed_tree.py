"""GraphedGreedyTree: a whole greedy tree-speculation step as static-shape device code.

The host-driven path (``MTPDrafter`` + ``verify_greedy``) builds trees node by node in Python and
reads the device after every depth; on a GPU that host work, not the model, sets the step time.
This module runs the same algorithm — MTP catch-up, EAGLE-2 tree growth with ``topk`` children
per frontier node, the best ``num_draft_tokens`` nodes, one tree-masked verify forward, greedy
acceptance, KV compaction with the rejected slots zeroed — entirely on the device, with shapes
that depend only on the batch bucket. So each step is three CUDA-graph replays (draft + verify +
accept; rollback; advance, which turns the outputs into the next step's inputs) and one small
device-to-host copy of the accepted tokens; a step over the same batch loads nothing.

Static shapes (per sequence; K = topk, D = depth, N = tree nodes, k = MTP modules, P = D + 1
nodes on an accepted path, C = P + CATCH_UP_SLACK catch-up rows, ``steady_catch_up_rows``):

- module d <= k gets C catch-up rows (the first ``c`` valid: the tokens committed since its last
  step, 1 <= c <= C; the slack lets an autoregressive step or two come in between)
  plus K frontier rows at depths 2..D; padding rows write past the committed entries and are
  zeroed right after the forward, exactly like the frontier rows (drafts leave nothing behind);
- depths beyond k reuse module k with K frontier rows;
- candidates: K at depth 1, K*K at each deeper depth; the N best by cumulative log-probability
  (ties: creation order, so the set is ancestor-closed) become the tree, in creation order.

A sequence qualifies when it decodes greedily without penalties and its MTP state is the steady
state of the previous speculative step (``eligible``); sampled sequences take the sampled
counterpart (``engine.spec.graphed_sampled``) and any other sequence (penalties, a seed, MTP
state not caught up) the host-driven path in the same engine step. Greedy output is identical to
autoregressive decoding whatever tree is drafted, and the tests check it. ``GraphedTreeStep``
holds what both tree policies share; ``GraphedGreedyTree`` is the greedy policy.

On CPU (``use_graphs=False``) the same code runs eagerly, which is how it is tested in CI.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from engine.cuda_graphs import capture_or_run_eagerly
from engine.host_tensor import int_tensor, to_device
from engine.kernels import run_kernel, triton_available
from engine.kv.block_pool import BlockOwner, BlockPool
from engine.kv.compaction import commit_tree_kv
from engine.launch_ahead import may_continue, rows_within
from engine.model.attention_batch import AttentionBatch
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.draft_layer import DraftLayer, forward_mtp_fused
from engine.params import SamplingParams
from engine.sequence import Sequence
from engine.spec.device_tree import (
    AcceptedPath,
    accept_greedy,
    grow_frontier,
    logprob_topk,
    select_tree,
)
from engine.spec.drafter import TreeBudget, steady_catch_up_rows
from engine.spec.graphed_rows import META_COLUMNS, WIN, RowInputs, RowPlan
from engine.spec.graphed_state import BucketBuffers, SteadyRows, StepLaunch, StepResults

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class GraphedTreeStep:
    """One speculative step over MTP modules as a static device program (base class).

    The base class owns what every tree policy shares: the batch buckets and their static
    buffers, the MTP catch-up rows, the sequential MTP forwards, the tree-masked verify forward,
    the outputs, the rollback and the graph capture. A subclass says which requests it serves
    (``serves``), how many frontier rows each depth has, how a depth's frontier hidden states
    become the next frontier (``_grow``) and how the verified tree is accepted (``_accept``).
    """

    # Whether the step's bookkeeping and MTP inputs take their Triton kernels (None: on CUDA
    # with Triton). Tests set it to compare the two paths: on CPU under the Triton interpreter,
    # on a GPU before the graphs are captured.
    FUSED_IO: bool | None = None

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: BlockPool,
        budget: TreeBudget,
        max_blocks: int,
        max_batch: int,
        use_graphs: bool,
        depth: int,
        num_nodes: int,
        frontier_rows: list[int],  # [m - 1] frontier rows of MTP forward m (0 at m = 1)
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        draft_layers: dict[int, DraftLayer] | None = None,  # the MTP modules' (``draft_layers``)
    ) -> None:
        cfg = model.config
        self.model, self.pool = model, pool
        self.k = cfg.num_mtp_modules
        self.D, self.N = depth, num_nodes
        self.C = steady_catch_up_rows(self.D)
        self.budget = budget
        self.hidden_size = cfg.hidden_size
        self.num_main_layers = cfg.num_hidden_layers
        self.dtype = next(model.parameters()).dtype
        self.device = pool.kv_cache.device
        self.block_size = pool.block_size
        self.max_blocks = max_blocks
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (1,)
        forwards = max(self.D, self.k)
        rows = [*frontier_rows, *[0] * forwards][:forwards]
        self.max_frontier = max(rows + [1])
        self.plans = [RowPlan.build(m, self.k, rows[m - 1], self.C, self.device)
                      for m in range(1, forwards + 1)]
        self.tree_window_start = self.k + self.C - 1  # window index of position L (the root)
        width = max(max(int(p.meta[1:, :, WIN].max()) for p in self.plans) + 1,
                    self.tree_window_start + self.N + 1)
        self.window_offsets = torch.arange(width, device=self.device) - self.tree_window_start  # [W]
        scratch_tokens = self.k + self.C + self.max_frontier + self.N + 2
        self.scratch = pool.allocate(-(-scratch_tokens // self.block_size), BlockOwner("graph-padding"))
        self.scratch_index = torch.tensor(self.scratch, device=self.device)
        self.pad_table = torch.full((max_blocks,), -1, dtype=torch.int32, device=self.device)
        self.pad_table[: len(self.scratch)] = self.scratch_index.to(torch.int32)
        self.trash_slot = self.scratch[-1] * self.block_size + self.block_size - 1
        # Every (layer, slot) row of the scratch blocks, for the fused zeroing (one launch).
        cache = pool.kv_cache
        scratch_slots = (self.scratch_index[:, None] * self.block_size
                         + torch.arange(self.block_size, device=self.device)).reshape(-1)  # fmt: skip
        self.scratch_rows = (
            torch.arange(cache.shape[0], device=self.device).repeat_interleave(scratch_slots.numel()),
            scratch_slots.repeat(cache.shape[0]),
        )  # ([layers * slots] layer, [layers * slots] slot)
        self.fused_io = (self.device.type == "cuda" and triton_available()) if self.FUSED_IO is None else self.FUSED_IO
        self.draft_layers = draft_layers or {}
        self.row_tables: tuple[Tensor, Tensor, Tensor] | None = None
        if self.fused_io:  # every depth's row tables packed for one kernel (``_row_inputs``)
            from engine.kernels.mtp_rows import pack_row_tables

            self.row_tables = pack_row_tables([p.meta for p in self.plans], [p.mask for p in self.plans],
                                              [p.ctx_offset for p in self.plans], [p.catch_up for p in self.plans])
        # live_rows[b][n]: the live mask of bucket b with n real sequences [b] bool.
        self.live_rows = {b: torch.arange(b, device=self.device)[None] < torch.arange(b + 1, device=self.device)[:, None]
                          for b in self.buckets}  # fmt: skip
        self._buffers = {b: BucketBuffers(b, self) for b in self.buckets}
        self._last_buf: BucketBuffers | None = None  # the bucket of the last step (its ``steady``)
        # Another runner's last bucket whose sequences this runner takes over (``adopt``).
        self._handoff: BucketBuffers | None = None
        self._ahead: StepLaunch | None = None  # the step launched ahead of its turn (``run``)
        for buf in self._buffers.values():
            buf.set_padding(0, self)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.capture_error: str | None = None
        # Which variant of the device program the loaded batch needs (sampled trees: whether a
        # request uses top-k / top-p); variants other than False are captured on first use.
        self.variant = False
        self._eager_variants: dict[bool, str] = {}  # variants whose capture failed -> error
        self._mempool: Any = None  # CUDA graph memory pool handle, shared by all captures
        # Rollback timing events (CUDA), reused round-robin: a step's pair is read before it
        # comes round again (the engine reads ``last_timings`` after each step, if at all).
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._next_event = 0
        self._stream: torch.cuda.Stream | None = None
        self._root = torch.zeros(0, dtype=torch.long)  # the step's root tokens [B] (``_step_start``)

    def _capture(self) -> None:
        """Capture every bucket's graphs (call at the end of a subclass's ``__init__``)."""
        if self.use_graphs:
            self.capture_error = capture_or_run_eagerly(self._capture_all, self._drop_graphs,
                                                        type(self).__name__)
            self.use_graphs = self.capture_error is None
            self._zero_scratch()

    def _drop_graphs(self) -> None:
        for buf in self._buffers.values():
            buf.graphs, buf.rollback_graph, buf.advance_graph = {}, None, None

    # ------------------------------------------------------------------ policy hooks
    def serves(self, params: SamplingParams) -> bool:
        """Whether requests with these sampling parameters take this step."""
        raise NotImplementedError

    def _grow(self, m: int, front_hidden: Tensor, buf: BucketBuffers) -> tuple[Tensor, Tensor]:
        """Depth ``m``'s children of the frontier rows' outputs ``front_hidden`` [B, F, H]:
        returns the next frontier's tokens [B, F'] and their input hidden states [B, F', H]."""
        raise NotImplementedError

    def _tree(self, buf: BucketBuffers) -> tuple[Tensor, Tensor, Tensor]:
        """The drafted tree: tokens [B, N+1] (root first), depths [B, N+1], mask [B, N+1, N+1]."""
        raise NotImplementedError

    def _accept(self, buf: BucketBuffers, tokens: Tensor, hidden: Tensor) -> AcceptedPath:
        """Accept a path of the verified tree (``hidden`` [B, N+1, H] of the verify forward)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ eligibility
    @property
    def capacity_needed_past_committed(self) -> int:
        """Slots a step writes from a sequence's first uncommitted position on, plus one."""
        return max(self.C + self.max_frontier, self.N + 1) + 1

    def capacity_needed(self, seq: Sequence) -> int:
        return seq.num_committed + self.capacity_needed_past_committed

    def eligible(self, seq: Sequence) -> bool:
        """A request this step serves, with the MTP state of a previous full speculative step."""
        if not self.serves(seq.sampling):
            return False
        L = seq.num_committed
        rows0 = seq.hidden_rows(0)
        if len(seq.tokens) != L + 1 or rows0 is None:
            return False
        c = L - seq.mtp_committed[0]
        if not 1 <= c <= self.C:
            return False
        if seq.pending_start[0] != L - c or rows0.shape[0] != c:
            return False
        for d in range(2, self.k + 1):
            rows = seq.hidden_rows(d - 1)
            mc = L - d - c + 1
            if seq.mtp_committed[d - 1] != mc or rows is None or rows.shape[0] != 1:
                return False
            if seq.pending_start[d - 1] != mc:
                return False
        cap = len(seq.block_ids) * self.block_size
        return self.capacity_needed(seq) <= cap and len(seq.block_ids) <= self.max_blocks

    def continues(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` are exactly the batch of this step's last run, untouched since
        (``SteadyRows.holds``): then all are eligible and their inputs are already loaded."""
        steady = self._last_buf.steady if self._last_buf is not None else None
        return steady is not None and steady.holds(seqs)

    def continuing(self, seqs: list[Sequence]) -> list[int] | None:
        """Each sequence's row in the last step's batch where it is untouched since (it needs
        no ``eligible`` check: its inputs are on the device), else -1; None: no last step."""
        steady = self._last_buf.steady if self._last_buf is not None else None
        return None if steady is None else steady.rows_of(seqs)

    def adopt(self, other: GraphedTreeStep, seqs: list[Sequence]) -> list[int] | None:
        """Take over from ``other`` (a runner of another budget, same policy) the sequences of
        its last step untouched since: their next-step inputs, which its step advanced on the
        device, become this runner's (``_load_inputs`` gathers them, truncating or padding the
        catch-up rows), so a switch of drafting arm loads nothing from the host. Returns each
        sequence's row in ``other``'s last batch (-1: not taken over; it is checked and loaded
        as usual), or None if none is taken over. A sequence is taken over if this runner's
        catch-up rows hold its accepted path and its blocks hold this runner's step.

        (On the H200 a chain-to-tree switch at 46 sequences, each loaded afresh, took 6.8 ms
        against ~2.3 for a tree step, and a tree-to-chain switch at batch 1 2.2 against 0.4:
        closed batches switch as they shrink, ~5 ms a round at batches 64-256.)"""
        src = other._last_buf
        steady = None if src is None else src.steady
        if steady is None or type(other) is not type(self) or other is self or other._ahead is not None:
            return None
        room = self.capacity_needed_past_committed
        rows = [
            r if r >= 0 and steady.num_accepted[r] + 1 <= self.C and len(s.block_ids) <= self.max_blocks
            and s.num_committed + room <= len(s.block_ids) * self.block_size else -1
            for s, r in zip(seqs, steady.rows_of(seqs), strict=True)
        ]  # fmt: skip
        if max(rows, default=-1) < 0:
            return None
        other._last_buf, self._handoff = None, src
        return rows

    # ------------------------------------------------------------------ host side of a step
    def _bucket(self, n: int) -> int:
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"batch of {n} exceeds the largest graphed bucket {self.buckets[-1]}")
        return bucket

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def launched_ahead(self) -> list[Sequence] | None:
        """The batch of the step launched ahead (``run``), None if there is none: the next
        ``run`` reads it, over these sequences or those of them still decoding."""
        return None if self._ahead is None else self._ahead.seqs

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], ahead: bool = False) -> tuple[StepResults, tuple[object, ...]]:
        """One speculative step for eligible ``seqs``; updates their KV/MTP state (not tokens).

        With a step launched ahead, ``seqs`` are its batch or those of them still decoding (in
        order), and that step is read instead. With ``ahead``, the next step over ``seqs`` is
        launched as soon as this one's outputs are read, before the caller's host work on them
        (commits, stop checks, outputs) and its next scheduling: the device runs it meanwhile.
        Sequences that stop in this step ride along in it (their blocks are zeroed when they
        are released, after it in stream order); the caller must read it with its next step.

        Returns per-sequence results and the rollback timing handle (CUDA events or seconds).
        """
        launch, self._ahead = self._ahead, None
        if launch is None:
            buf = self._buffers[self._bucket(len(seqs))]
            launch = self._replay(buf, seqs, self._load_inputs(buf, seqs))
            rows = list(range(len(seqs)))
        else:
            rows = rows_within(seqs, launch.seqs)
        results = self._finish(launch, rows)
        self._last_buf = launch.buf
        if ahead and launch.buf.steady is not None and launch.buf.steady.fits and may_continue(seqs, 1):
            self._ahead = self._launch_ahead(launch, rows, seqs)
        return results, launch.timing

    def launch(self, seqs: list[Sequence]) -> None:
        """Queue a step over ``seqs``, all ``eligible``, without reading it: the next ``run``
        over them (or those of them still decoding) reads it, as it reads a step launched
        ahead (the first step of a batch just prefilled: ``LLMEngine._launch_after_prefill``)."""
        buf = self._buffers[self._bucket(len(seqs))]
        self._ahead = self._replay(buf, seqs, self._load_inputs(buf, seqs))

    def reset(self) -> None:
        """Back to rest after a failed engine step: no step launched ahead, no last batch whose
        device inputs a next step would take as its own, every bucket padded, the scratch zeroed."""
        self._ahead, self._last_buf, self._handoff = None, None, None
        for buf in self._buffers.values():
            buf.steady = None
            buf.set_padding(0, self)
        self._zero_scratch()

    def discard_ahead(self) -> None:
        """Forget the step launched ahead, none of whose sequences decodes any more (their blocks
        are released; the step's writes to them are zeroed after it in stream order)."""
        self._ahead, self._last_buf = None, None

    def _launch_ahead(self, last: StepLaunch, rows: list[int], seqs: list[Sequence]) -> StepLaunch:
        """The next step over ``seqs`` (rows ``rows`` of ``last``), its inputs those ``last``
        advanced on the device; the host state it starts from is the one ``_finish`` left."""
        src, n = last.buf, len(seqs)
        assert src.steady is not None
        num_accepted = src.steady.num_accepted
        c = [num_accepted[r] + 1 for r in rows]
        buf = self._buffers[self._bucket(n)]
        if buf is src and n == len(last.seqs):
            self.variant = last.variant  # the same batch: its inputs are in place
        else:
            self._gather_inputs(src, buf, list(range(n)), rows)
            buf.set_padding(n, self)
            self._load_sampling(buf, seqs)
        # Until it is read, the device inputs are the launched step's, not ``_finish``'s.
        src.steady, self._last_buf = None, None
        return self._replay(buf, seqs, c)

    def _replay(self, buf: BucketBuffers, seqs: list[Sequence], catch_up: list[int]) -> StepLaunch:
        """Queue a step over the loaded inputs: the device program, a copy of its outputs to the
        host, the rollback, the advance to the next step's inputs."""
        if self.use_graphs and self.variant not in buf.graphs | self._eager_variants:
            # Re-running the step on the loaded inputs is idempotent (every slot it writes is
            # rewritten), so a variant can be captured on real inputs.
            error = capture_or_run_eagerly(lambda: self._capture_bucket(buf), lambda: None,
                                           f"{type(self).__name__} variant {self.variant}")  # fmt: skip
            if error is not None:
                self._eager_variants[self.variant] = error
        graph = buf.graphs.get(self.variant)
        if graph is not None:
            graph.replay()
        else:
            self._draft_verify_accept(buf)
        # The results go to the host first: the rollback and the advance then run on the
        # device while the host reads them (``_finish``), not before. The static outputs are
        # overwritten by the next replay: the MTP rows are copied out now, on the device.
        n = len(seqs)
        next_rows = buf.next_rows[:n].clone()  # [n, P, H]
        next_carry = buf.next_carry[:n].clone()  # [n, k-1, H]
        host, copied = buf.packed_hosts[buf.next_host], buf.copy_events[buf.next_host]
        buf.next_host ^= 1
        host.copy_(buf.packed, non_blocking=copied is not None)
        if copied is not None:
            copied.record()
        timing = self._timed_rollback(buf)
        if buf.advance_graph is not None:
            buf.advance_graph.replay()
        else:
            self._advance(buf)
        return StepLaunch(buf, list(seqs), catch_up, host, copied, next_rows, next_carry, timing, self.variant)

    def _load_inputs(self, buf: BucketBuffers, seqs: list[Sequence]) -> list[int]:
        """Copy the batch into the bucket's static inputs; returns each sequence's ``c``.

        Sequences of the last step untouched since are gathered from its bucket on the device
        (a closed batch whose requests finish one by one: loading all 256 again from the host,
        their deferred rows handed out one by one, made each such step 20 ms against 5.5 ms on
        the H200); the others are loaded from the host."""
        n = len(seqs)
        L = [s.num_committed for s in seqs]
        c = [Li - s.mtp_committed[0] for Li, s in zip(L, seqs, strict=True)]
        last, self._last_buf = self._last_buf, None
        if self._handoff is not None:  # another runner's last step (``adopt``)
            last, self._handoff = self._handoff, None
        steady = None if last is None else last.steady
        if last is not None:
            last.steady = None
        if steady is not None and last is buf and (steady.checked is seqs or steady.holds(seqs)):
            # The batch of the bucket's last step, untouched: ``_advance`` has already turned
            # that step's outputs into these inputs on the device.
            self.variant = steady.variant
            return c
        rows = [-1] * n if steady is None else steady.rows_of(seqs)
        kept = [i for i, r in enumerate(rows) if r >= 0]
        if kept:
            assert last is not None
            self._gather_inputs(last, buf, kept, [rows[i] for i in kept])
        if len(kept) < n:
            fresh = [i for i, r in enumerate(rows) if r < 0]
            self._load_fresh(buf, [seqs[i] for i in fresh], fresh, [L[i] for i in fresh], [c[i] for i in fresh])
        buf.set_padding(n, self)
        self._load_sampling(buf, seqs)
        return c

    def _gather_inputs(self, src: BucketBuffers, dst: BucketBuffers, to: list[int], rows: list[int]) -> None:
        """Rows ``rows`` of ``src``'s inputs (advanced by its step) become rows ``to`` of ``dst``.
        ``src`` may be another runner's (``adopt``): of its catch-up rows (``tail``, ``rows0``:
        the first ``c`` valid) the first ``min`` of the two widths are copied, and ``dst``'s
        others zeroed, as a load from the host leaves them."""
        index_to = to_device(int_tensor(to), self.device)
        index_from = to_device(int_tensor(rows), self.device)
        for name in ("tables", "L", "c", "tail", "rows0", "carry"):
            s, d = getattr(src, name), getattr(dst, name)
            if name in ("tail", "rows0") and s.shape[1] != d.shape[1]:
                width = min(s.shape[1], d.shape[1])
                if d.shape[1] > width:
                    d[:, width:].index_fill_(0, index_to, 0)
                s, d = s[:, :width], d[:, :width]
            d.index_copy_(0, index_to, s.index_select(0, index_from))  # read before dst is written

    def _load_fresh(
        self, buf: BucketBuffers, seqs: list[Sequence], rows: list[int], L: list[int], c: list[int]
    ) -> None:
        """Load ``seqs`` from the host into rows ``rows`` of the bucket's inputs."""
        n, C = len(seqs), self.C
        width = max(len(s.block_ids) for s in seqs)
        # One host tensor per input; table columns past a sequence's own blocks are never read.
        tail = torch.tensor(
            [s.tokens[Li - ci + 1 : Li + 1] + [0] * (C - ci) for s, Li, ci in zip(seqs, L, c, strict=True)]
        )  # [n, C]
        tables = torch.tensor([s.block_ids + [-1] * (width - len(s.block_ids)) for s in seqs],
                              dtype=torch.int32)  # [n, width]
        rows0 = torch.nn.utils.rnn.pad_sequence(
            [s.hidden_rows(0) for s in seqs], batch_first=True  # type: ignore[misc]
        )  # [n, max c, H]
        index = to_device(int_tensor(rows), self.device)
        buf.tail.index_copy_(0, index, to_device(tail, self.device))
        buf.tables[:, :width].index_copy_(0, index, to_device(tables, self.device))
        buf.L.index_copy_(0, index, to_device(int_tensor(L), self.device))
        buf.c.index_copy_(0, index, to_device(int_tensor(c), self.device))
        buf.rows0[:, : rows0.shape[1]].index_copy_(0, index, rows0)
        if self.k > 1:
            carry = torch.cat([s.hidden_rows(d) for s in seqs for d in range(1, self.k)])  # type: ignore[misc]
            buf.carry.index_copy_(0, index, carry.view(n, self.k - 1, self.hidden_size))

    def _advance(self, buf: BucketBuffers) -> None:
        """Turn the step's outputs into the inputs of the next step over the same sequences
        (what ``_load_inputs`` would load after ``_finish``): ``L += a + 1``, ``c = a + 1``, the
        catch-up tokens are the accepted tokens and the bonus, module 1's rows the accepted
        path's verify states, the carry the catch-up's last rows. Padding rows stay as set.
        One fused kernel on CUDA with Triton (``engine.kernels.tree_step_io``)."""
        if self.fused_io:
            from engine.kernels.tree_step_io import advance_triton

            if run_kernel("advance", lambda: advance_triton(
                buf.packed, buf.live, buf.tail, buf.L, buf.c, buf.next_rows, buf.rows0,
                buf.next_carry, buf.carry, self.D)) is not None:  # fmt: skip
                return
        self._advance_torch(buf)

    def _advance_torch(self, buf: BucketBuffers) -> None:
        """``_advance`` as torch ops (the reference of the fused kernel)."""
        C, D = self.C, self.D
        a = buf.packed[:, 0]  # [B] accepted draft tokens
        bonus = buf.packed[:, 1:2]  # [B, 1]
        accepted = buf.packed[:, 3 : 3 + D]  # [B, D] path tokens below the root
        j = torch.arange(C, device=self.device)[None]  # [1, C]
        tail = torch.where(j < a[:, None], accepted.gather(1, j.clamp(max=D - 1).expand_as(buf.tail)),
                           torch.where(j == a[:, None], bonus, 0))  # [B, C]  # fmt: skip
        live = buf.live
        buf.tail.copy_(torch.where(live[:, None], tail, buf.tail))
        buf.L.add_(torch.where(live, a + 1, 0))
        buf.c.copy_(torch.where(live, a + 1, buf.c))
        buf.rows0[:, : D + 1].copy_(buf.next_rows)
        buf.carry.copy_(buf.next_carry)

    def _load_sampling(self, buf: BucketBuffers, seqs: list[Sequence]) -> None:
        """Per-sequence sampling inputs (none for greedy trees)."""

    def _timed_rollback(self, buf: BucketBuffers) -> tuple[object, ...]:
        """Run the rollback: timed by CUDA events on GPU (read lazily), by the clock on CPU."""
        graph = buf.rollback_graph
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            self._rollback(buf)
            return (time.perf_counter() - t0,)
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device)
            self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                            for _ in range(4)]  # fmt: skip
        start, end = self._events[self._next_event]
        self._next_event = (self._next_event + 1) % len(self._events)
        start.record(self._stream)
        if graph is not None:
            graph.replay()
        else:
            self._rollback(buf)
        end.record(self._stream)
        return (start, end)

    def _finish(self, launch: StepLaunch, rows: list[int]) -> StepResults:
        """Read the step's outputs and move the KV/MTP bookkeeping of the sequences of rows
        ``rows`` forward (the others stopped since it was launched: nothing of theirs is read).

        This loop is most of the step's host work per sequence (on the H200's host ~12 us each
        once: 3 ms of a 17.7 ms step at batch 256). No tensor is made per sequence: its pending
        MTP rows stay in the step's copied outputs (``Sequence.deferred``, ``SteadyRows``)
        until something reads them, which the next step over the same batch does not (views
        per sequence cost 1.7 ms at batch 256 on a 2-core host); the acceptance statistics are
        counted for the batch at once (``StepResults``)."""
        buf, seqs, c = launch.buf, launch.seqs, launch.c
        n, D, k = len(seqs), self.D, self.k
        if launch.copied is not None:
            launch.copied.synchronize()  # the step's one device -> host copy (``_replay``)
        packed_array = launch.packed[:n].numpy()  # a view: a later step's copy reuses it
        packed = packed_array.tolist()
        num_accepted = [row[0] for row in packed]
        committed_now = [-1] * n  # rows of stopped sequences match nothing (``rows_of``)
        steady = SteadyRows(tuple(seqs), launch.next_rows, launch.next_carry, num_accepted, committed_now,
                             False, launch.variant)  # fmt: skip
        refs = steady.refs = [(steady, i) for i in range(n)]
        tokens: list[list[int]] = []
        room = 1 << 62  # the fewest free slots past a sequence's committed entries
        bs = self.block_size
        offsets = range(k)
        for i in rows:
            s, row, a = seqs[i], packed[i], num_accepted[i]
            tokens.append([*row[3 : 3 + a], row[1]])  # path tokens below the root, the bonus
            L = s.num_committed
            s.mtp_committed = [m + c[i] for m in s.mtp_committed]
            s.pending_start = [L - d for d in offsets]
            s.deferred = refs[i]
            s.num_committed = L + a + 1
            committed_now[i] = L + a + 1
            room = min(room, len(s.block_ids) * bs - L - a - 1)
        steady.fits = room >= self.capacity_needed_past_committed
        buf.steady = steady
        if len(rows) < n:
            packed_array = packed_array[rows]
        return StepResults(tokens, [num_accepted[i] for i in rows], packed_array[:, 3 + D : 4 + 2 * D].copy(),
                           packed_array[:, 4 + 2 * D : 5 + 3 * D].copy())  # fmt: skip

    # ------------------------------------------------------------------ device program
    def _step_start(self, buf: BucketBuffers) -> tuple[Tensor, Tensor, Tensor]:
        """The flat cache slots of the step's positions window ``L - k - C + 1 + w`` (positions
        below 0 clamped to 0) [B, W], each sequence's last catch-up row ``c - 1`` [B] and its
        token, the tree's root [B]: one fused kernel on CUDA with Triton."""
        if self.fused_io:
            from engine.kernels.tree_step_io import step_start_triton

            fused = run_kernel("step_start", lambda: step_start_triton(
                buf.tables, buf.L, buf.c, buf.tail, self.window_offsets, self.block_size))  # fmt: skip
            if fused is not None:
                return fused
        return self._step_start_torch(buf)

    def _step_start_torch(self, buf: BucketBuffers) -> tuple[Tensor, Tensor, Tensor]:
        """``_step_start`` as torch ops (the reference of the fused kernel)."""
        window = self._slots(buf.tables, (buf.L[:, None] + self.window_offsets).clamp(min=0))
        last = buf.c - 1
        return window, last, buf.tail.gather(1, last[:, None])[:, 0]

    def _verify_inputs(self, buf: BucketBuffers, depth: Tensor, window: Tensor) -> tuple[Tensor, Tensor]:
        """The verify forward's positions ``L + depth`` [B * (N+1)] and context lengths [B] int32;
        the tree's slots go into ``buf.tree_slots`` (its slot mapping, the rollback's input).
        One fused kernel on CUDA with Triton."""
        if self.fused_io:
            from engine.kernels.tree_step_io import verify_inputs_triton

            fused = run_kernel("verify_inputs", lambda: verify_inputs_triton(
                buf.L, depth, window, self.tree_window_start, buf.tree_slots))  # fmt: skip
            if fused is not None:
                return fused
        return self._verify_inputs_torch(buf, depth, window)

    def _verify_inputs_torch(self, buf: BucketBuffers, depth: Tensor, window: Tensor) -> tuple[Tensor, Tensor]:
        """``_verify_inputs`` as torch ops (the reference of the fused kernel)."""
        start = self.tree_window_start
        buf.tree_slots.copy_(window[:, start : start + depth.shape[1]])
        return (buf.L[:, None] + depth).reshape(-1), buf.L.to(torch.int32)

    def _slots(self, tables: Tensor, positions: Tensor) -> Tensor:
        """Flat cache slots of ``positions`` [B, R] through block ``tables`` [B, max_blocks]."""
        index = positions // self.block_size  # [B, R] table column
        # slot = block * bs + position % bs, in two kernels after the gather
        return torch.add(positions, tables.gather(1, index) - index, alpha=self.block_size)

    def _mtp_forward(
        self,
        buf: BucketBuffers,
        plan: RowPlan,
        rows: RowInputs,  # this forward's attention inputs (``_row_inputs``)
        tok_parts: list[Tensor],  # [B, r_i] the rows' tokens, in parts (sum r_i = R)
        prev_parts: list[Tensor],  # [B, r_i, H] the previous depth's hidden of each row, in parts
    ) -> Tensor:  # [B, R, H]
        B, R = buf.bucket, plan.rows
        batch = AttentionBatch(
            positions=rows.positions,
            slot_mapping=rows.slots,
            block_tables=buf.tables,
            ctx_lens=rows.ctx_lens,
            query_start=buf.query_start[R],
            new_mask=rows.new_mask,
            query_ctx_lens=rows.query_ctx_lens,
        )
        # The input rows from their parts (one kernel on CUDA: no concatenation first).
        fused = self.model.mtp_layer(plan.module).fuse_input_parts(
            self.model.model.embed_tokens, tok_parts, prev_parts, fused=self.fused_io or None
        )  # [B * R, H]
        # Through the drafting layer where the engine built one (engine/model/draft_layer.py).
        hidden = forward_mtp_fused(self.model, self.draft_layers, plan.module, fused, batch, self.pool.kv_cache)
        return hidden.view(B, R, -1)

    def _row_inputs(self, buf: BucketBuffers, window: Tensor) -> list[RowInputs]:
        """Every drafting depth's attention inputs (``RowPlan.inputs_torch``), at the step's
        start: they depend only on ``L``, ``c`` and the slot window. Their slots to zero go to
        ``buf.draft_zero`` (``_zero_drafts``). One kernel on CUDA (``engine.kernels.mtp_rows``)."""
        B = buf.bucket
        if self.row_tables is not None:
            from engine.kernels.mtp_rows import mtp_rows_triton

            rows, tables = [p.rows for p in self.plans], self.row_tables
            fused = run_kernel("mtp_rows", lambda: mtp_rows_triton(
                buf.L, buf.c, window, *tables, rows, self.trash_slot,
                META_COLUMNS, buf.draft_zero))  # fmt: skip
            if fused is not None:
                pos, slots, ctx, masks, qctx, zero = fused
                flat = [part.split([B * r for r in rows]) for part in (pos, slots, qctx, zero)]
                new_masks = masks.split([B * r * r for r in rows])
                return [RowInputs(flat[0][i], flat[1][i], ctx[i], new_masks[i].view(B * r, r), flat[2][i],
                                   flat[3][i]) for i, r in enumerate(rows)]  # fmt: skip
        out = []
        for plan, zero_out in zip(self.plans, buf.draft_zero_parts, strict=True):
            inputs = plan.inputs_torch(buf.L, buf.c, window, self.trash_slot)
            zero_out.copy_(inputs.zero)
            out.append(inputs)
        return out

    def _zero_drafts(self, buf: BucketBuffers) -> None:
        """Zero what every MTP forward of the step wrote past its committed rows (drafts and
        padding rows) in one go. Deferring it to the last depth changes nothing: a forward reads
        only its module's committed entries and its own rows, never an earlier depth's drafts."""
        if self.fused_io:
            from engine.kernels.tree_step_io import zero_cache_rows_triton

            done = run_kernel("zero_cache_rows", lambda: zero_cache_rows_triton(
                self.pool.kv_cache, buf.draft_zero_layer, buf.draft_zero))  # fmt: skip
            if done is not None:
                return
        cache = self.pool.kv_cache
        slots_per_layer = cache.shape[1] * cache.shape[2]
        flat = cache.view(-1, cache.shape[-1])  # [layers * slots, D]
        flat.index_fill_(0, buf.draft_zero_layer * slots_per_layer + buf.draft_zero, 0)

    def _draft_verify_accept(self, buf: BucketBuffers) -> None:
        B, C, D, N, k, H = buf.bucket, self.C, self.D, self.N, self.k, self.hidden_size
        window, last_row_index, self._root = self._step_start(buf)  # [B, W], [B], [B]
        row_inputs = self._row_inputs(buf, window)  # every depth's, at once
        last = last_row_index[:, None, None].expand(B, 1, H)  # gather index of row c-1
        front_tok = front_prev = None
        catch_prev = [buf.rows0]  # the catch-up rows' previous-depth hidden states, in parts
        for m, plan in enumerate(self.plans, start=1):
            tok_parts, prev_parts = [], []
            if plan.catch_up:
                tok_parts.append(buf.tail)
                prev_parts += catch_prev
            if plan.frontier:
                assert front_tok is not None and front_prev is not None
                tok_parts.append(front_tok)
                prev_parts.append(front_prev)
            out = self._mtp_forward(buf, plan, row_inputs[m - 1], tok_parts, prev_parts)
            if plan.catch_up and m < k:  # module m+1's catch-up rows: the carried row, then these
                # The last catch-up row (hidden at index L - m), written where the next step's
                # carry is read from (it is an output: nothing reads it during the step).
                last_row = torch.gather(out[:, :C], 1, last, out=buf.next_carry[:, m - 1 : m])  # [B, 1, H]
                catch_prev = [buf.carry[:, m - 1 : m], out[:, : C - 1]]
            elif m == 1:  # a single module: its last catch-up row is the root's
                last_row = out[:, :C].gather(1, last)  # [B, 1, H]
            if m <= D:  # the root's row at depth 1, the frontier rows deeper
                front = last_row if m == 1 else out[:, C * plan.catch_up :]  # [B, F, H]
                front_tok, front_prev = self._grow(m, front, buf)
        self._zero_drafts(buf)
        tree_tok, depth, mask = self._tree(buf)
        # One target forward over every tree.
        positions, ctx_lens = self._verify_inputs(buf, depth, window)  # and buf.tree_slots
        batch = AttentionBatch(
            positions=positions,
            slot_mapping=buf.tree_slots.reshape(-1),
            block_tables=buf.tables,
            ctx_lens=ctx_lens,
            query_start=buf.query_start[N + 1],
            new_mask=mask.reshape(B * (N + 1), N + 1),
        )
        hidden = self.model.forward_target(tree_tok.reshape(-1), batch, self.pool.kv_cache)
        hidden = hidden.view(B, N + 1, -1)
        acc = self._accept(buf, tree_tok, hidden)
        self._write_outputs(buf, acc, tree_tok, hidden)

    def _write_outputs(self, buf: BucketBuffers, acc: AcceptedPath, tree_tok: Tensor, hidden: Tensor) -> None:
        """The step's results into the static outputs: ``packed`` (for the host), module 1's
        next rows (the verify states of the accepted path) and the rollback's path and kept
        depths (its tree slots are written before the verify). One fused kernel on CUDA with
        Triton."""
        if self.fused_io:
            from engine.kernels.tree_step_io import write_outputs_triton

            if run_kernel("write_outputs", lambda: write_outputs_triton(
                acc.num_accepted.contiguous(), acc.bonus.contiguous(), acc.path.contiguous(),
                acc.has_child.contiguous(), acc.sibling_rank.contiguous(), acc.on_path.contiguous(),
                tree_tok.contiguous(), hidden.contiguous(), buf.packed, buf.next_rows, buf.path,
                buf.keep)) is not None:  # fmt: skip
                return
        self._write_outputs_torch(buf, acc, tree_tok, hidden)

    def _write_outputs_torch(self, buf: BucketBuffers, acc: AcceptedPath, tree_tok: Tensor, hidden: Tensor) -> None:
        """``_write_outputs`` as torch ops (the reference of the fused kernel)."""
        B, P, H = hidden.shape[0], acc.path.shape[1], hidden.shape[2]
        path = acc.path  # [B, P]
        # The outputs are written in place (``out=``, views of the static buffers): each is one
        # kernel, not a kernel and a copy.
        torch.cat([
            acc.num_accepted, acc.bonus, tree_tok.gather(1, path), acc.has_child.long(),
            acc.sibling_rank.long(),
        ], 1, out=buf.packed)  # fmt: skip
        # Next step's module-1 inputs: the verify hidden states of the accepted path.
        torch.gather(hidden, 1, path[:, :, None].expand(B, P, H), out=buf.next_rows)
        # Rollback inputs: accepted path -> contiguous slots L..L+a, everything else zeroed.
        buf.path.copy_(path)
        buf.keep.copy_(acc.on_path)

    def _rollback(self, buf: BucketBuffers) -> None:
        """Move accepted target KV to contiguous slots, zero rejected slots and the scratch."""
        commit_tree_kv(self.pool.kv_cache, self.num_main_layers, buf.tree_slots, buf.path, buf.keep)
        self._zero_scratch()

    def _zero_scratch(self) -> None:
        if self.fused_io:
            from engine.kernels.tree_step_io import zero_cache_rows_triton

            if run_kernel("zero_cache_rows", lambda: zero_cache_rows_triton(self.pool.kv_cache, *self.scratch_rows)) is not None:
                return
        self.pool.kv_cache.index_fill_(1, self.scratch_index, 0)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def _capture_all(self) -> None:
        for bucket in sorted(self._buffers, reverse=True):  # largest first: smaller reuse memory
            self._capture_bucket(self._buffers[bucket])

    @torch.inference_mode()
    def _capture_bucket(self, buf: BucketBuffers) -> None:
        """Capture the current variant's step (and the rollback, once) for one bucket."""
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (Triton compile/autotune) outside the capture
                self._draft_verify_accept(buf)
                self._rollback(buf)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self._draft_verify_accept(buf)
        if buf.rollback_graph is None:
            rollback = torch.cuda.CUDAGraph()
            with torch.cuda.graph(rollback, pool=self._mempool):
                self._rollback(buf)
            buf.rollback_graph = rollback
        if buf.advance_graph is None:  # captured, not run: the loaded inputs stay as they are
            advance = torch.cuda.CUDAGraph()
            with torch.cuda.graph(advance, pool=self._mempool):
                self._advance(buf)
            buf.advance_graph = advance
        # The first replay uploads a graph (milliseconds): do it here, not in a served step
        # (idempotent on the loaded inputs, like the warm-up).
        graph.replay()
        buf.rollback_graph.replay()
        buf.graphs[self.variant] = graph


class GraphedGreedyTree(GraphedTreeStep):
    """Greedy EAGLE-2 tree speculation over MTP modules as one static device program."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: BlockPool,
        budget: TreeBudget,
        max_blocks: int,
        max_batch: int,
        use_graphs: bool,
        reuse_last_module: bool = True,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        draft_layers: dict[int, DraftLayer] | None = None,
    ) -> None:
        cfg = model.config
        if cfg.num_mtp_modules < 1 or not budget.speculates:
            raise ValueError("GraphedGreedyTree needs MTP modules and a speculating budget")
        K = min(budget.topk, cfg.vocab_size)
        D = budget.depth if reuse_last_module else min(budget.depth, cfg.num_mtp_modules)
        N = min(budget.num_draft_tokens, K + (D - 1) * K * K)
        if N < D:
            raise ValueError("num_draft_tokens must be at least the depth for the graphed tree")
        super().__init__(model, pool, budget, max_blocks, max_batch, use_graphs, D, N,
                         [0] + [K] * (D - 1), buckets, draft_layers)  # fmt: skip
        self.K = K
        # Candidate depth of each candidate index (depth-major creation order).
        depths = [1] * K + [m for m in range(2, D + 1) for _ in range(K * K)]
        self.cand_depth = torch.tensor(depths, dtype=torch.long, device=self.device)  # [T]
        self.first_frontier = torch.arange(K, device=self.device)  # [K] candidates 0..K-1
        # Each bucket's candidates (scores, tokens, parent candidate indices [B, T]), written
        # in place depth by depth; the depth-1 candidates' parents are the root (-1) for good.
        T = len(depths)
        self._cand = {b: (torch.zeros(b, T, dtype=torch.float32, device=self.device),
                          torch.zeros(b, T, dtype=torch.long, device=self.device),
                          torch.full((b, T), -1, dtype=torch.long, device=self.device))
                      for b in self.buckets}  # fmt: skip
        self._front: tuple[Tensor, Tensor] | None = None  # frontier scores, candidate indices
        self._capture()

    def serves(self, params: SamplingParams) -> bool:
        return params.greedy and not params.stays_on_host

    def _grow(self, m: int, front_hidden: Tensor, buf: BucketBuffers) -> tuple[Tensor, Tensor]:
        B, K, H = buf.bucket, self.K, self.hidden_size
        cand_score, cand_tok, cand_parent = self._cand[B]  # [B, T] each
        fused = self.fused_io or None  # the Triton kernels also where fused_io is forced on
        if m == 1:
            score, token = logprob_topk(self.model.lm_head(front_hidden[:, 0]), K,
                                        out=(cand_score[:, :K], cand_tok[:, :K]), fused=fused)  # [B, K]
            self._front = score, self.first_frontier.expand(B, K)
            return token, front_hidden.expand(B, K, H)
        assert self._front is not None
        child_logp, child_tok = logprob_topk(self.model.lm_head(front_hidden), K, fused=fused)  # [B, K, K]
        start = K + (m - 2) * K * K
        cols = slice(start, start + K * K)
        _, _, _, front_score, front_idx, token, hidden = grow_frontier(
            *self._front, child_logp, child_tok, front_hidden, start,
            out=(cand_score[:, cols], cand_tok[:, cols], cand_parent[:, cols]), fused=fused,
        )  # [B, K] x3, [B, K, H]; the depth's candidates [B, K*K] into the buffers
        self._front = front_score, front_idx
        return token, hidden

    def _tree(self, buf: BucketBuffers) -> tuple[Tensor, Tensor, Tensor]:
        cand_score, cand_tok, cand_parent = self._cand[buf.bucket]
        tree_tok, self._parents, self._depth, mask = select_tree(
            cand_score, cand_parent, cand_tok, self.cand_depth, self._root, self.N, self.D,
        )  # [B, N+1] x3, [B, N+1, N+1]
        return tree_tok, self._depth, mask

    def _accept(self, buf: BucketBuffers, tokens: Tensor, hidden: Tensor) -> AcceptedPath:
        target = self.model.lm_head(hidden).argmax(-1)  # [B, N+1] (the argmax of the logits)
        acc = accept_greedy(tokens, self._parents, self._depth, target, self.D)
        return acc
