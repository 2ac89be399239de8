"""GraphedCatchUp: the MTP modules' catch-up over many committed rows, as CUDA-graph replays.

A sequence's MTP modules fall behind its committed tokens after a prefill (the prompt's rows)
and after autoregressive steps (adaptive speculation's lag). Catching up runs module 1, then 2,
... over those rows. Eagerly that is ~175 small launches per module whatever the row count, so
on a GPU it is host-bound: one 64-token prompt took 13 ms on the H200 (``gpu`` preset) for
0.6 ms of GPU work. Here each module's forward is captured once per shape (``S`` sequences of
``R`` rows) and replayed, so a catch-up costs a replay per module and pass.

Layout of a shape: sequence ``i`` owns rows ``[i*R, (i+1)*R)``: its ``n_i`` real rows first,
then ``R - n_i`` padding rows that form a dummy sequence over the scratch blocks (the attention
batch holds ``2S`` sequences: real 0, dummy 0, real 1, dummy 1, ...). Padding rows see only
each other, write only scratch slots (zeroed after each replay), and their outputs are dropped,
so the real rows get what ``MTPDrafter``'s eager forward computes. The host loads per sequence
only its row count, first hidden index (= the module's committed entries), block table and
tokens; the captured program derives every row's position, cache slot, context limit and mask
(no per-row host work: at 64 prompts, per-row host work had cost as much as the eager forward).
A sequence with more than the largest ``R`` rows to go is caught up in several passes; a later
pass sees the earlier rows in the cache, as a chunked prefill does.

On CPU (``use_graphs=False``) the same padded code runs eagerly, which is how it is tested.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from engine.cuda_graphs import capture_or_run_eagerly
from engine.kv.block_pool import BlockOwner, BlockPool
from engine.model.attention_batch import AttentionBatch
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM, mtp_band_mask
from engine.sequence import Sequence

# (sequences, rows per sequence) captured: a prompt's rows, a lag of a few hundred tokens.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 16), (4, 16), (16, 16), (64, 16),
    (1, 64), (4, 64), (16, 64), (64, 64),
    (1, 256), (4, 256), (16, 256),
)  # fmt: skip

_N, _START = range(2)  # columns of _ShapeBuffers.meta


class _ShapeBuffers:
    """Static inputs and output of one (sequences, rows) shape; at rest, all rows are padding."""

    def __init__(self, seqs: int, rows: int, owner: GraphedCatchUp) -> None:
        dev, n = owner.device, seqs * rows
        self.seqs, self.rows = seqs, rows
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # [S*R] row tokens (host)
        self.prev = torch.zeros(n, owner.hidden_size, dtype=owner.dtype, device=dev)  # [S*R, H]
        self.meta = torch.zeros(seqs, 2, dtype=torch.long, device=dev)  # [S, (n, start)] (host)
        self.tables = owner.pad_table.repeat(seqs, 1)  # [S, max_blocks] int32 (host)
        self.local = torch.arange(rows, device=dev).repeat(seqs, 1)  # [S, R] row index in its sequence
        self.out = torch.zeros(n, owner.hidden_size, dtype=owner.dtype, device=dev)  # [S*R, H]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # module -> graph


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
    ) -> None:
        self.model, self.pool = model, pool
        self.device = dev = pool.kv_cache.device
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = model.config.hidden_size
        self.num_modules = model.config.num_mtp_modules
        self.max_blocks = max_blocks
        smallest = min(s for s, _ in shapes)
        kept = [(s, r) for s, r in shapes if s <= max(max_batch, smallest)]
        self.row_buckets = tuple(sorted({r for _, r in kept}))
        self.max_rows = R = self.row_buckets[-1]
        self.block_size = bs = pool.block_size
        self.scratch = pool.allocate(-(-R // bs), BlockOwner("graph-padding"))
        self._scratch_index = torch.tensor(self.scratch, device=dev)
        self.pad_table = torch.full((max_blocks,), -1, dtype=torch.int32, device=dev)
        self.pad_table[: len(self.scratch)] = self._scratch_index.to(torch.int32)
        self._pad_table_host = self.pad_table.tolist()
        self.pad_slots = torch.tensor([self.scratch[j // bs] * bs + j % bs for j in range(R)], device=dev)
        self.causal = torch.ones(R, R, dtype=torch.bool, device=dev).tril()  # [R, R] padding rows
        # [R, R] per module: catch-up rows see each other within the training band.
        self.band = {d: mtp_band_mask(R, d, dev) for d in range(1, self.num_modules + 1)}
        self._shapes = {(s, r): _ShapeBuffers(s, r, self) for s, r in kept}
        self.use_graphs = use_graphs and dev.type == "cuda"
        self.capture_error: str | None = None
        if self.use_graphs:
            self.capture_error = capture_or_run_eagerly(self._capture_all, self._drop_graphs,
                                                        "GraphedCatchUp")  # fmt: skip
            self.use_graphs = self.capture_error is None

    # ------------------------------------------------------------------ the device program
    def _batch(self, module: int, buf: _ShapeBuffers) -> AttentionBatch:
        """The attention batch of the loaded rows, derived on the device (static shapes)."""
        S, R, bs = buf.seqs, buf.rows, self.block_size
        n, start = buf.meta[:, _N : _N + 1], buf.meta[:, _START : _START + 1]  # [S, 1]
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
        base = torch.arange(S, device=self.device)[:, None] * R  # [S, 1]
        starts = torch.cat([torch.cat([base, base + n], 1).flatten(), base.new_full((1,), S * R)])
        tables = torch.stack([buf.tables, self.pad_table.expand(S, -1)], 1).flatten(0, 1)  # [2S, W]
        ctx = torch.stack([start[:, 0], torch.zeros_like(start[:, 0])], 1).flatten()  # [2S]
        return AttentionBatch(
            positions.flatten(), slots.flatten(), tables, ctx.to(torch.int32), starts.to(torch.int32),
            mask.flatten(0, 1), qctx.flatten().to(torch.int32),
        )  # fmt: skip

    def _forward(self, module: int, buf: _ShapeBuffers) -> None:
        batch = self._batch(module, buf)
        if module == self.num_modules:  # the last module's outputs feed nobody: its entries only
            self.model.write_mtp_latents(module, buf.prev, buf.ids, batch, self.pool.kv_cache)
        else:
            buf.out.copy_(self.model.forward_mtp(module, buf.prev, buf.ids, batch, self.pool.kv_cache))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for key in sorted(self._shapes, key=lambda sr: sr[0] * sr[1], reverse=True):  # big first
            buf = self._shapes[key]
            for module in range(1, self.num_modules + 1):
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (Triton compile) outside the capture
                        self._forward(module, buf)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    self._forward(module, buf)
                graph.replay()  # the first replay uploads the graph: not in a served step
                buf.graphs[module] = graph
        self._zero_scratch()

    def _drop_graphs(self) -> None:
        for buf in self._shapes.values():
            buf.graphs = {}
        self._zero_scratch()

    def _zero_scratch(self, layer: int | None = None) -> None:
        cache = self.pool.kv_cache if layer is None else self.pool.kv_cache[layer : layer + 1]
        cache.index_fill_(1, self._scratch_index, 0)

    # ------------------------------------------------------------------ runs
    def _staged(self, host: Tensor) -> Tensor:
        """``host`` in pinned memory when the buffers are on CUDA (PyTorch's host allocator keeps
        it until the asynchronous copy from it is done), as it is otherwise."""
        return host.pin_memory() if self.device.type == "cuda" else host

    def _shape_for(self, count: int, rows: int) -> tuple[int, int]:
        """The smallest captured shape for ``count`` sequences of at most ``rows`` rows, or the
        largest sequence count of the smallest row bucket that fits (the rest goes next)."""
        r = next(b for b in self.row_buckets if b >= rows)
        fits = sorted(s for s, rr in self._shapes if rr == r)
        return next((s for s in fits if s >= count), fits[-1]), r

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
        tables: list[list[int]] = []
        for (seq, start, _), n in zip(work, counts, strict=True):
            ids += seq.tokens[start + module : start + module + n]  # row t consumes x_{t+module}
            ids += [0] * (R - n)
            meta += [n, start]
            tables.append(seq.block_ids + [-1] * (self.max_blocks - len(seq.block_ids)))
        unused = S - len(work)
        ids += [0] * (R * unused)
        meta += [0, 0] * unused
        tables += [self._pad_table_host] * unused
        # Copies from pinned memory do not wait for the device: the previous module's replay
        # runs while these inputs are built (a copy from pageable memory waits for it first).
        buf.ids.copy_(self._staged(torch.tensor(ids)), non_blocking=True)
        buf.meta.copy_(self._staged(torch.tensor(meta).view(S, 2)), non_blocking=True)
        buf.tables.copy_(self._staged(torch.tensor(tables, dtype=torch.int32)), non_blocking=True)
        dest = self._staged(torch.tensor(list(itertools.chain.from_iterable(
            range(i * R, i * R + n) for i, n in enumerate(counts))))).to(self.device, non_blocking=True)  # fmt: skip
        prevs = [prev for _, _, prev in work]
        buf.prev.index_copy_(0, dest, prevs[0] if len(prevs) == 1 else torch.cat(prevs))
        graph = buf.graphs.get(module)
        if graph is not None:
            graph.replay()
        else:
            self._forward(module, buf)
        self._zero_scratch(self.model.mtp_cache_layer(module))
        if module == self.num_modules:
            return [None] * len(counts)
        out = buf.out.clone()  # [S*R, H]: the next replay overwrites the static output
        return [out[i * R : i * R + n] for i, n in enumerate(counts)]
