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
so the real rows get what ``MTPDrafter``'s eager forward computes. A sequence with more than the
largest ``R`` rows to go is caught up in several passes; a later pass sees the earlier rows in
the cache, as a chunked prefill does.

On CPU (``use_graphs=False``) the same padded code runs eagerly, which is how it is tested.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.batch_builder import SeqRows
from engine.cuda_graphs import capture_or_run_eagerly
from engine.kv.block_pool import BlockOwner, BlockPool
from engine.model.attention_batch import AttentionBatch
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.sequence import Sequence

# (sequences, rows per sequence) captured: a prompt's rows, a lag of a few hundred tokens.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 16), (4, 16), (16, 16), (64, 16),
    (1, 64), (4, 64), (16, 64), (64, 64),
    (1, 256), (4, 256), (16, 256),
)  # fmt: skip


class _ShapeBuffers:
    """Static inputs and output of one (sequences, rows) shape; at rest, all rows are padding."""

    def __init__(self, seqs: int, rows: int, owner: GraphedCatchUp) -> None:
        dev, n = owner.device, seqs * rows
        self.seqs, self.rows = seqs, rows
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # [n]
        self.prev = torch.zeros(n, owner.hidden_size, dtype=owner.dtype, device=dev)  # [n, H]
        self.positions = torch.arange(rows, device=dev).repeat(seqs)  # [n]
        self.slots = owner.pad_slots[:rows].repeat(seqs)  # [n]
        self.tables = owner.pad_table.repeat(2 * seqs, 1)  # [2S, max_blocks] int32
        self.ctx = torch.zeros(2 * seqs, dtype=torch.int32, device=dev)  # [2S]
        starts = torch.arange(seqs + 1, dtype=torch.int32).repeat_interleave(2)[1:] * rows
        self.starts = starts.to(dev)  # [2S + 1]: every real sequence empty
        self.mask = owner.causal[:rows, :rows].repeat(seqs, 1).to(dev)  # [n, R] bool
        self.qctx = torch.zeros(n, dtype=torch.int32, device=dev)  # [n]
        self.out = torch.zeros(n, owner.hidden_size, dtype=owner.dtype, device=dev)  # [n, H]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # module -> graph

    def batch(self) -> AttentionBatch:
        return AttentionBatch(self.positions, self.slots, self.tables, self.ctx, self.starts,
                              self.mask, self.qctx)  # fmt: skip


class GraphedCatchUp:
    """Runs MTP catch-up rows (``MTPDrafter._catch_up_rows``) through static, padded shapes."""

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
        self.device = pool.kv_cache.device
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = model.config.hidden_size
        self.num_modules = model.config.num_mtp_modules
        self.max_blocks = max_blocks
        smallest = min(s for s, _ in shapes)
        kept = [(s, r) for s, r in shapes if s <= max(max_batch, smallest)]
        self.row_buckets = tuple(sorted({r for _, r in kept}))
        self.max_rows = self.row_buckets[-1]
        block_size = pool.block_size
        self.scratch = pool.allocate(-(-self.max_rows // block_size), BlockOwner("graph-padding"))
        self._scratch_index = torch.tensor(self.scratch, device=self.device)
        self.pad_table = torch.full((max_blocks,), -1, dtype=torch.int32, device=self.device)
        self.pad_table[: len(self.scratch)] = self._scratch_index.to(torch.int32)
        self.pad_slots = torch.tensor(
            [self.scratch[j // block_size] * block_size + j % block_size for j in range(self.max_rows)],
            device=self.device,
        )  # [max_rows] the dummy sequences' slots
        self._pad_slots_host = self.pad_slots.tolist()
        self._pad_table_host = self.pad_table.tolist()
        self.causal = torch.ones(self.max_rows, self.max_rows, dtype=torch.bool).tril()
        self._shapes = {(s, r): _ShapeBuffers(s, r, self) for s, r in kept}
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.capture_error: str | None = None
        if self.use_graphs:
            self.capture_error = capture_or_run_eagerly(self._capture_all, self._drop_graphs,
                                                        "GraphedCatchUp")  # fmt: skip
            self.use_graphs = self.capture_error is None

    # ------------------------------------------------------------------ capture
    def _forward(self, module: int, buf: _ShapeBuffers) -> None:
        hidden = self.model.forward_mtp(module, buf.prev, buf.ids, buf.batch(), self.pool.kv_cache)
        buf.out.copy_(hidden)

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
    def _shape_for(self, count: int, rows: int) -> tuple[int, int]:
        """The smallest captured shape for ``count`` sequences of at most ``rows`` rows, or the
        largest sequence count of the smallest row bucket that fits (the rest goes next)."""
        r = next(b for b in self.row_buckets if b >= rows)
        fits = sorted(s for s, rr in self._shapes if rr == r)
        return next((s for s in fits if s >= count), fits[-1]), r

    @torch.inference_mode()
    def run(self, module: int, work: list[tuple[Sequence, SeqRows, int]]) -> list[Tensor]:
        """Module ``module`` over each sequence's catch-up rows (``(seq, rows, first hidden
        index)``, at most ``max_rows`` rows each): writes their latent KV and returns their
        hidden outputs ``[n_i, H]`` in ``work`` order. Committing them is the caller's part."""
        outs: list[Tensor] = []
        i = 0
        while i < len(work):
            rows = max(len(r.token_ids) for _, r, _ in work[i:])
            seqs, width = self._shape_for(len(work) - i, rows)
            chunk = work[i : i + seqs]
            outs += self._run_shape(module, self._shapes[(seqs, width)], [r for _, r, _ in chunk])
            i += len(chunk)
        return outs

    def _run_shape(self, module: int, buf: _ShapeBuffers, rows: list[SeqRows]) -> list[Tensor]:
        R, S, bs = buf.rows, buf.seqs, self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qctx: list[int] = []
        ctx: list[int] = []
        starts = [0]
        dest: list[int] = []
        tables: list[list[int]] = []
        mask = torch.zeros(S * R, R, dtype=torch.bool)  # [S*R, R]
        pad_row = self._pad_table_host
        for i in range(S):
            r = rows[i] if i < len(rows) else None
            n = len(r.token_ids) if r is not None else 0
            if r is not None:
                assert r.query_ctx_lens is not None and r.prev_hidden is not None
                ids += r.token_ids
                positions += r.positions
                blocks = r.block_ids
                slots += [blocks[p // bs] * bs + p % bs for p in range(r.ctx_len, r.ctx_len + n)]
                qctx += r.query_ctx_lens
                ctx.append(r.ctx_len)
                tables.append(blocks + [-1] * (self.max_blocks - len(blocks)))
                mask[i * R : i * R + n, :n] = r.mask
                dest += range(i * R, i * R + n)
            else:
                ctx.append(0)
                tables.append(pad_row)
            pad = R - n  # the dummy sequence after it
            ids += [0] * pad
            positions += range(pad)
            slots += self._pad_slots_host[:pad]
            qctx += [0] * pad
            ctx.append(0)
            tables.append(pad_row)
            mask[i * R + n : (i + 1) * R, :pad] = self.causal[:pad, :pad]
            starts += [i * R + n, (i + 1) * R]
        dev = self.device
        buf.ids.copy_(torch.tensor(ids))
        buf.positions.copy_(torch.tensor(positions))
        buf.slots.copy_(torch.tensor(slots))
        buf.qctx.copy_(torch.tensor(qctx, dtype=torch.int32))
        buf.ctx.copy_(torch.tensor(ctx, dtype=torch.int32))
        buf.starts.copy_(torch.tensor(starts, dtype=torch.int32))
        buf.tables.copy_(torch.tensor(tables, dtype=torch.int32))
        buf.mask.copy_(mask)
        prev = [r.prev_hidden for r in rows if r.prev_hidden is not None]
        buf.prev.index_copy_(0, torch.tensor(dest, device=dev), prev[0] if len(prev) == 1 else torch.cat(prev))
        graph = buf.graphs.get(module)
        if graph is not None:
            graph.replay()
        else:
            self._forward(module, buf)
        self._zero_scratch(self.model.mtp_cache_layer(module))
        out = buf.out.clone()  # [S*R, H]: the next replay overwrites the static output
        return [out[i * R : i * R + len(r.token_ids)] for i, r in enumerate(rows)]
