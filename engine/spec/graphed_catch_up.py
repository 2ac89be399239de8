"""GraphedCatchUp: the MTP modules' catch-up over many committed rows, as CUDA-graph replays.

A sequence's MTP modules fall behind its committed tokens after a prefill (the prompt's rows)
and after autoregressive steps (adaptive speculation's lag). Catching up runs module 1, then 2,
... over those rows. Eagerly that is ~175 small launches per module whatever the row count, so
on a GPU it is host-bound: one 64-token prompt took 13 ms on the H200 (``gpu`` preset) for
0.6 ms of GPU work. Here the forwards are captured once per shape (``S`` sequences of ``R`` rows)
and replayed.

Layout of a shape: sequence ``i`` owns rows ``[i*R, (i+1)*R)``: its ``n_i`` real rows first,
then ``R - n_i`` padding rows that form a dummy sequence over the scratch blocks (the attention
batch holds ``2S`` sequences: real 0, dummy 0, real 1, dummy 1, ...). Padding rows see only
each other, write only scratch slots (zeroed after each replay), and their outputs are dropped,
so the real rows get what ``MTPDrafter``'s eager forward computes. The host loads per sequence
only its row count, first hidden index (= the module's committed entries), block table and
tokens; the captured program derives every row's position, cache slot, context limit and mask
(no per-row host work: at 64 prompts, per-row host work had cost as much as the eager forward).

Fused replay (``catch_up``): where every module's rows of a sequence fit one pass, one graph per
shape runs modules 1..k back to back on the device. Module d's rows are its carried row (the
depth-(d-1) row it had pending before this catch-up: none after a prefill, one in the steady
state a speculative step leaves) followed by module d-1's outputs of this same replay. The host
works out per sequence and module the row count, first hidden index, carried rows and where its
tokens start, and loads them with module 1's rows, the carried rows and a window of tokens
once; only each module's newest output row (the one the next module leaves pending) comes back.
A sequence the fused pass does not cover (more rows than the largest ``R``, several carried
rows, an irregular queue) takes per-module replays (``run``): a pass of at most ``R`` rows per
module at a time, module 1's passes first; a later pass sees the earlier rows in the cache, as
a chunked prefill does.

On CPU (``use_graphs=False``) the same padded code runs eagerly, which is how it is tested.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from engine.cuda_graphs import capture_or_run_eagerly
from engine.host_tensor import copy_to_device, int_table, int_tensor, to_device
from engine.kv.block_pool import BlockOwner, BlockPool
from engine.model.attention_batch import AttentionBatch
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM, mtp_band_mask
from engine.model.draft_layer import DraftLayer, forward_mtp
from engine.sequence import Sequence

# (sequences, rows per sequence) captured: a prompt's rows, a lag of a few hundred tokens. Row
# buckets double: a 64-token prompt behind by a few autoregressive tokens (a closed batch that
# decoded while it filled) is 65-70 rows, and with buckets of 64 and 256 it took 16 replays of
# 16 sequences x 256 rows at the H200's batch 256 (75% padding; the first drafting step of each
# round ~100 ms, the round 270 ms) where 4 replays of 64 x 128 do.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 16), (4, 16), (16, 16), (64, 16),
    (1, 64), (4, 64), (16, 64), (64, 64),
    (1, 128), (4, 128), (16, 128), (64, 128),
    (1, 256), (4, 256), (16, 256),
)  # fmt: skip

# Columns of the meta buffers: a module's row count and first hidden index (= its committed
# entries); fused replays also its carried rows (0 or 1) and its first token in the window.
_N, _START, _CARRIED, _TOKEN = range(4)

# A sequence's fused pass: row counts n_d of modules d = 1..k, carried rows p_d of d = 2..k.
_Plan = tuple[list[int], list[int]]


class _ShapeBuffers:
    """Static inputs and outputs of one (sequences, rows) shape; at rest, all rows are padding."""

    def __init__(self, seqs: int, rows: int, owner: GraphedCatchUp) -> None:
        dev, n, H, k = owner.device, seqs * rows, owner.hidden_size, owner.num_modules
        self.seqs, self.rows = seqs, rows
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # [S*R] row tokens (host)
        # [S*R, H] module inputs: per sequence's rows (``run``), or packed (``_fused_forward``:
        # module 1's rows, sequence after sequence).
        self.prev = torch.zeros(n, H, dtype=owner.dtype, device=dev)
        self.meta = torch.zeros(seqs, 2, dtype=torch.long, device=dev)  # [S, (n, start)] (host)
        self.tables = owner.pad_table.repeat(seqs, 1)  # [S, max_blocks] int32 (host)
        self.local = torch.arange(rows, device=dev).repeat(seqs, 1)  # [S, R] row index in its sequence
        self.first = torch.arange(seqs, device=dev)[:, None] * rows  # [S, 1] a sequence's first row
        self.out = torch.zeros(n, H, dtype=owner.dtype, device=dev)  # [S*R, H]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # module -> graph
        # Fused replay: one host copy fills the token windows and the meta (host).
        self.width = W = rows + k - 1  # module d's tokens start at most d - 1 after module 1's
        self.fused_in = torch.zeros(seqs * (W + 4 * k), dtype=torch.long, device=dev)
        self.window = self.fused_in[: seqs * W].view(seqs, W)  # [S, W] tokens from module 1's first
        self.fused_meta = self.fused_in[seqs * W :].view(seqs, k, 4)  # [S, k, (n, start, carried, token)]
        self.carry = torch.zeros(seqs * max(k - 1, 1), H, dtype=owner.dtype, device=dev)  # [<= S*(k-1), H] packed
        self.newest = torch.zeros(seqs, max(k - 1, 0), H, dtype=owner.dtype, device=dev)  # [S, k-1, H]
        self.fused_graph: torch.cuda.CUDAGraph | None = None


class GraphedCatchUp:
    """Runs MTP catch-up rows (``MTPDrafter._pending_rows``) through static, padded shapes."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: BlockPool,
        max_blocks: int,
        max_batch: int,
        use_graphs: bool,
        shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES,
        draft_layers: dict[int, DraftLayer] | None = None,  # the MTP modules' drafting forward
    ) -> None:
        self.model, self.pool = model, pool
        self.draft_layers = draft_layers or {}
        self.device = dev = pool.kv_cache.device
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = model.config.hidden_size
        self.num_modules = model.config.num_mtp_modules
        self.max_blocks = max_blocks
        smallest = min(s for s, _ in shapes)
        # Rows beyond what a block table holds never come (a short context), and their padding
        # would not fit the table either.
        longest = max(max_blocks * pool.block_size, min(r for _, r in shapes))
        kept = [(s, r) for s, r in shapes if s <= max(max_batch, smallest) and r <= longest]
        self.row_buckets = tuple(sorted({r for _, r in kept}))
        self.max_rows = R = self.row_buckets[-1]
        self.block_size = bs = pool.block_size
        self.scratch = pool.allocate(-(-R // bs), BlockOwner("graph-padding"))
        self._scratch_index = torch.tensor(self.scratch, device=dev)
        first = model.mtp_cache_layer(1)
        self._mtp_layers = slice(first, first + self.num_modules)
        self.pad_table = torch.full((max_blocks,), -1, dtype=torch.int32, device=dev)
        self.pad_table[: len(self.scratch)] = self._scratch_index.to(torch.int32)
        self._pad_table_host = self.pad_table.tolist()
        self.pad_slots = torch.tensor([self.scratch[j // bs] * bs + j % bs for j in range(R)], device=dev)
        self.causal = torch.ones(R, R, dtype=torch.bool, device=dev).tril()  # [R, R] padding rows
        # [R, R] per module: catch-up rows see each other within the training band.
        self.band = {d: mtp_band_mask(R, d, dev) for d in range(1, self.num_modules + 1)}
        self._no_rows = torch.zeros(0, self.hidden_size, dtype=self.dtype, device=dev)  # [0, H]
        self._shapes = {(s, r): _ShapeBuffers(s, r, self) for s, r in kept}
        # Replays (eager runs without graphs) so far: fused (modules 1..k), single-module.
        self.fused_runs = self.module_runs = 0
        self.use_graphs = use_graphs and dev.type == "cuda"
        self.capture_error: str | None = None
        if self.use_graphs:
            self.capture_error = capture_or_run_eagerly(self._capture_all, self._drop_graphs,
                                                        "GraphedCatchUp")  # fmt: skip
            self.use_graphs = self.capture_error is None

    # ------------------------------------------------------------------ the device program
    def _batch(self, module: int, buf: _ShapeBuffers, meta: Tensor) -> AttentionBatch:
        """The attention batch of module ``module``'s loaded rows (``meta`` [S, >= 2]: row count,
        first hidden index), derived on the device (static shapes)."""
        S, R, bs = buf.seqs, buf.rows, self.block_size
        n, start = meta[:, _N : _N + 1], meta[:, _START : _START + 1]  # [S, 1]
        j = buf.local  # [S, R]
        real = j < n  # [S, R]
        pad_j = (j - n).clamp(min=0)  # [S, R] index among the dummy sequence's rows
        entry = start + j  # [S, R] cache position of a real row (module committed + j)
        blocks = buf.tables.long().gather(1, (entry // bs).clamp(max=self.max_blocks - 1))
        slots = torch.where(real, blocks * bs + entry % bs, self.pad_slots[pad_j])  # [S, R]
        positions = torch.where(real, entry + module, pad_j)  # row t = start + j consumes x_{t+d}
        # Row t sees committed entries < t - d + 2 (the band), at most the module's committed.
        qctx = torch.where(real, torch.minimum(start, entry - module + 2), 0)  # [S, R]
        band = self.band[module][:R, :R]
        mask = torch.where(real[..., None], band[j], self.causal[pad_j, :R])  # [S, R, R]
        base = buf.first  # [S, 1]
        starts = torch.cat([torch.cat([base, base + n], 1).flatten(), base.new_full((1,), S * R)])
        tables = torch.stack([buf.tables, self.pad_table.expand(S, -1)], 1).flatten(0, 1)  # [2S, W]
        ctx = torch.stack([start[:, 0], torch.zeros_like(start[:, 0])], 1).flatten()  # [2S]
        return AttentionBatch(
            positions.flatten(), slots.flatten(), tables, ctx.to(torch.int32), starts.to(torch.int32),
            mask.flatten(0, 1), qctx.flatten().to(torch.int32),
        )  # fmt: skip

    def _forward(self, module: int, buf: _ShapeBuffers) -> None:
        batch = self._batch(module, buf, buf.meta)
        if module == self.num_modules:  # the last module's outputs feed nobody: its entries only
            self.model.write_mtp_latents(module, buf.prev, buf.ids, batch, self.pool.kv_cache)
        else:
            buf.out.copy_(forward_mtp(self.model, self.draft_layers, module, buf.prev, buf.ids, batch,
                                      self.pool.kv_cache))  # fmt: skip

    def _fused_forward(self, buf: _ShapeBuffers) -> None:
        """Modules 1..k back to back over the loaded rows (``_run_fused``), then the padding's
        scratch entries zeroed."""
        S, R, W, k = buf.seqs, buf.rows, buf.width, self.num_modules
        j, meta, kv = buf.local, buf.fused_meta, self.pool.kv_cache  # [S, R], [S, k, 4]
        n1 = meta[:, 0, _N]  # [S]
        packed = (n1.cumsum(0) - n1)[:, None] + j  # [S, R] where module 1's rows were loaded
        prev = buf.prev.index_select(0, packed.flatten().clamp(max=S * R - 1))  # [S*R, H]
        carried = meta[:, 1:, _CARRIED]  # [S, k-1] 0 or 1 carried row per module d >= 2
        carry_at = (carried.flatten().cumsum(0) - 1).clamp(min=0).view(S, k - 1)  # [S, k-1] in buf.carry
        out = prev
        for d in range(1, k + 1):
            m = meta[:, d - 1]  # [S, 4]
            if d > 1:  # module d's rows: its carried row, then module d-1's rows of this replay
                shift = m[:, _CARRIED, None]  # [S, 1]
                new = out.index_select(0, (buf.first + (j - shift).clamp(min=0)).flatten())  # [S*R, H]
                carry = buf.carry.index_select(0, carry_at[:, d - 2])  # [S, H]
                prev = torch.where((j < shift)[..., None], carry[:, None], new.view(S, R, -1)).flatten(0, 1)
            ids = buf.window.gather(1, (m[:, _TOKEN, None] + j).clamp(max=W - 1)).flatten()  # [S*R]
            batch = self._batch(d, buf, m)
            if d == k:  # the last module's outputs feed nobody: its entries only
                self.model.write_mtp_latents(d, prev, ids, batch, kv)
            else:
                out = forward_mtp(self.model, self.draft_layers, d, prev, ids, batch, kv)  # [S*R, H]
                newest = buf.first[:, 0] + (m[:, _N] - 1).clamp(min=0)  # [S]
                buf.newest[:, d - 1] = out.index_select(0, newest)  # [S, H]
        self._zero_scratch(self._mtp_layers)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())

        def capture(program: Callable[[], None], warm_ups: int) -> torch.cuda.CUDAGraph:
            with torch.cuda.stream(stream):
                for _ in range(warm_ups):  # warm up (Triton compile) outside the capture
                    program()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                program()
            graph.replay()  # the first replay uploads the graph: not in a served step
            return graph

        for key in sorted(self._shapes, key=lambda sr: sr[0] * sr[1], reverse=True):  # big first
            buf = self._shapes[key]
            for module in range(1, self.num_modules + 1):
                buf.graphs[module] = capture(functools.partial(self._forward, module, buf), 2)
            # The modules' kernels are compiled by now: one warm-up.
            buf.fused_graph = capture(functools.partial(self._fused_forward, buf), 1)
        self._zero_scratch()

    def _drop_graphs(self) -> None:
        for buf in self._shapes.values():
            buf.graphs, buf.fused_graph = {}, None
        self._zero_scratch()

    def _zero_scratch(self, layers: slice = slice(None)) -> None:
        self.pool.kv_cache[layers].index_fill_(1, self._scratch_index, 0)

    def reset(self) -> None:
        """Back to rest after a failed engine step: every run loads all its inputs anyway, so
        only the scratch blocks its padding rows write are zeroed."""
        self._zero_scratch()

    # ------------------------------------------------------------------ runs
    def _tables(self, seqs: list[Sequence], slots: int) -> Tensor:
        """Block tables of ``seqs``, then of the padding's dummy sequences up to ``slots``:
        ``[slots, max_blocks]`` int32 on the host."""
        rows = [seq.block_ids for seq in seqs] + [self._pad_table_host] * (slots - len(seqs))
        return int_table(rows, self.max_blocks, -1)

    def _shape_for(self, count: int, rows: int) -> tuple[int, int]:
        """The smallest captured shape for ``count`` sequences of at most ``rows`` rows, or the
        largest sequence count of the smallest row bucket that fits (the rest goes next)."""
        r = next(b for b in self.row_buckets if b >= rows)
        fits = sorted(s for s, rr in self._shapes if rr == r)
        return next((s for s in fits if s >= count), fits[-1]), r

    @torch.inference_mode()
    def catch_up(self, seqs: list[Sequence]) -> list[Sequence]:
        """Catch up, in fused replays, every sequence of ``seqs`` that one pass covers
        (``_plan``), leaving it as ``MTPDrafter.catch_up``'s per-module passes would; return the
        others, in order, for those passes."""
        fused: list[tuple[Sequence, _Plan]] = []
        rest: list[Sequence] = []
        for seq in seqs:
            plan = self._plan(seq)
            if plan is None:
                rest.append(seq)
            elif any(plan[0]):  # else nothing to catch up
                fused.append((seq, plan))
        i = 0
        while i < len(fused):
            shape = self._shape_for(len(fused) - i, max(max(counts) for _, (counts, _) in fused[i:]))
            chunk = fused[i : i + shape[0]]
            self._run_fused(self._shapes[shape], chunk)
            i += len(chunk)
        return rest

    def _plan(self, seq: Sequence) -> _Plan | None:
        """Row counts ``n_d`` of modules d = 1..k in one fused pass over ``seq`` (what
        ``MTPDrafter._pending_rows(seq, d, keep=1)`` takes once module d-1 has run) and carried
        rows ``p_d`` of d = 2..k; None where one pass would not leave ``seq`` as the per-module
        passes do: more than ``max_rows`` rows, more than one carried row, a queue that does not
        start at its module's committed entries, more than module d-1's newest row left over."""
        rows = seq.hidden_rows(0)  # hands deferred rows out (``Sequence.deferred``), folds a tail
        if seq.has_hidden_tail:
            for depth in range(1, self.num_modules):
                seq.hidden_rows(depth)
        # The queues are plain lists now (read and written directly here and in ``_run_fused``).
        hidden, starts, committed = seq.pending_hidden, seq.pending_start, seq.mtp_committed
        last = len(seq.tokens) - 1  # the pending token's index: module d commits rows t < last - d
        have = 0 if rows is None else rows.shape[0]
        if have and starts[0] != committed[0]:
            return None
        n = max(0, min(have, last - 1 - committed[0]))
        counts, carried = [n], []
        for d in range(2, self.num_modules + 1):
            c, rows = committed[d - 1], hidden[d - 1]
            p = 0 if rows is None else rows.shape[0]
            if p > 1 or c + p != committed[d - 2] or (p and starts[d - 1] != c):
                return None
            m = max(0, min(p + n, last - d - c))
            if p + n - m > 1:
                return None
            counts.append(m)
            carried.append(p)
            n = m
        return (counts, carried) if max(counts) <= self.max_rows else None

    def _run_fused(self, buf: _ShapeBuffers, work: list[tuple[Sequence, _Plan]]) -> None:
        """One fused replay over ``work`` (at most ``buf.seqs`` sequences of at most
        ``buf.rows`` rows per module), then each sequence's committed counts and queues."""
        S, W, k = buf.seqs, buf.width, self.num_modules
        windows: list[int] = []
        meta: list[int] = []
        firsts: list[Tensor] = []  # module 1's rows [n_1, H]
        carry: list[Tensor] = []  # carried rows [1, H], by sequence then module
        for seq, (counts, carried) in work:
            c = seq.mtp_committed
            a = c[0] + 1  # module 1's first token: its row c_1 consumes x_{c_1 + 1}
            window = seq.tokens[a : a + W]
            windows += window
            windows += [0] * (W - len(window))
            for d, (n, p) in enumerate(zip(counts, [0, *carried], strict=True), 1):
                meta += (n, c[d - 1], p, c[d - 1] + d - a)  # row t of module d consumes x_{t+d}
            _, rows = seq.take_hidden(0, c[0] + counts[0] - 1)
            if rows is not None:
                firsts.append(rows)
            carry += [seq.pending_hidden[d] for d, p in enumerate(carried, 1) if p]  # type: ignore[misc]
        unused = S - len(work)
        windows += [0] * (W * unused)
        meta += [0] * (4 * k * unused)
        copy_to_device(buf.fused_in, int_tensor(windows + meta))
        copy_to_device(buf.tables, self._tables([seq for seq, _ in work], S))
        if firsts:
            rows = firsts[0] if len(firsts) == 1 else torch.cat(firsts)  # [sum n_1, H]
            buf.prev[: rows.shape[0]].copy_(rows)
        if carry:
            buf.carry[: len(carry)].copy_(carry[0] if len(carry) == 1 else torch.cat(carry))
        if buf.fused_graph is not None:
            buf.fused_graph.replay()
        else:
            self._fused_forward(buf)
        self.fused_runs += 1
        # The next replay overwrites the static rows: only each module's newest row leaves.
        newest = buf.newest[: len(work)].clone().view(-1, 1, self.hidden_size).unbind(0)  # [1, H] each
        for i, (seq, (counts, carried)) in enumerate(work):
            c, hidden, start = seq.mtp_committed, seq.pending_hidden, seq.pending_start
            for d in range(1, k):  # queue d: module d's rows module d+1 has not taken
                n, m = counts[d - 1], counts[d]
                if not (n or m):
                    continue  # neither module ran: its carried row stays
                if carried[d - 1] + n - m:  # module d's newest row stays pending
                    hidden[d], start[d] = newest[i * (k - 1) + d - 1], c[d - 1] + n - 1
                else:
                    hidden[d], start[d] = self._no_rows, c[d] + m
            for d in range(k):
                c[d] += counts[d]

    @torch.inference_mode()
    def run(self, module: int, work: list[tuple[Sequence, int, Tensor]]) -> list[Tensor | None]:
        """Module ``module`` over each sequence's pending rows (``(seq, first hidden index,
        depth-(module - 1) inputs [n, H])``, n <= ``max_rows``; the first index is the module's
        committed count): writes their latent KV and returns their outputs ``[n, H]`` in
        ``work`` order (None for the last module, whose outputs nobody reads: it writes its
        entries only). Committing them is the caller's part."""
        outs: list[Tensor | None] = []
        i = 0
        while i < len(work):
            rows = max(prev.shape[0] for _, _, prev in work[i:])
            seqs, width = self._shape_for(len(work) - i, rows)
            chunk = work[i : i + seqs]
            outs += self._run_shape(module, self._shapes[(seqs, width)], chunk)
            i += len(chunk)
        return outs

    def _run_shape(
        self, module: int, buf: _ShapeBuffers, work: list[tuple[Sequence, int, Tensor]]
    ) -> list[Tensor | None]:
        R, S = buf.rows, buf.seqs
        counts = [prev.shape[0] for _, _, prev in work]
        ids: list[int] = []
        meta: list[int] = []
        for (seq, start, _), n in zip(work, counts, strict=True):
            ids += seq.tokens[start + module : start + module + n]  # row t consumes x_{t+module}
            ids += [0] * (R - n)
            meta += [n, start]
        unused = S - len(work)
        ids += [0] * (R * unused)
        meta += [0, 0] * unused
        # Copies from pinned memory do not wait for the device: the previous module's replay
        # runs while these inputs are built (a copy from pageable memory waits for it first).
        copy_to_device(buf.ids, int_tensor(ids))
        copy_to_device(buf.meta, int_tensor(meta).view(S, 2))
        copy_to_device(buf.tables, self._tables([seq for seq, _, _ in work], S))
        dest = to_device(int_tensor(list(itertools.chain.from_iterable(
            range(i * R, i * R + n) for i, n in enumerate(counts)))), self.device)  # fmt: skip
        prevs = [prev for _, _, prev in work]
        buf.prev.index_copy_(0, dest, prevs[0] if len(prevs) == 1 else torch.cat(prevs))
        graph = buf.graphs.get(module)
        if graph is not None:
            graph.replay()
        else:
            self._forward(module, buf)
        self.module_runs += 1
        layer = self.model.mtp_cache_layer(module)
        self._zero_scratch(slice(layer, layer + 1))
        if module == self.num_modules:
            return [None] * len(counts)
        out = buf.out.clone()  # [S*R, H]: the next replay overwrites the static output
        return [out[i * R : i * R + n] for i, n in enumerate(counts)]
