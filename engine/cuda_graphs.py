"""CUDA graphs of the target forward: static buffers, one graph per (batch bucket, tokens).

On a GPU a small model's forward is dominated by kernel-launch overhead, so the target forward —
the autoregressive step (1 token per sequence) and the tree verification step (``N + 1`` tokens
per sequence) — is captured once per batch bucket and replayed. Both modes use the same graphs,
so speculative and autoregressive figures stay comparable.

Shapes are fixed per graph: ``bucket`` sequences of exactly ``tokens`` new tokens each, block
tables ``max_blocks`` wide. A step with fewer sequences is padded with dummy sequences that
write to a reserved scratch block (zeroed after each replay) and whose outputs are dropped.
Steps whose sequences have different token counts, or MTP-style per-query limits, run eagerly.

Prefill chunks get their own graphs (``prefill_tokens``): a chunk of ``n`` tokens runs in the
``(bucket, T)`` graph with ``T >= n``, its ``T - n`` padding rows writing to the scratch block and
attending to the chunk's real tokens only (so no real row sees them and every padding row sees
at least one key); their outputs are dropped. Eager, a prefill costs one launch per operation
whatever its length: on an H200 a 64-token prompt of the demo model takes 5.5 ms eagerly and
0.6 ms replayed (``scripts/gpu_prefill_check.py``).

Every input is copied into the static buffers before a replay; nothing in the captured region
reads host values (the Triton attention kernel has no host syncs and a shape-only grid).
``StaticTargetForward(use_graphs=False)`` runs the same padded static path eagerly, which is how
the padding logic is tested on CPU.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable

import torch

from engine.batch_builder import SeqRows
from engine.host_tensor import copy_to_device, int_table, int_tensor, to_device
from engine.kv.block_pool import BlockOwner, BlockPool
from engine.model.attention_batch import AttentionBatch
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Tokens per sequence of the captured prefill shapes; (bucket, T) pairs of more than twice the
# prefill chunk's rows are not captured (a chunk's rows, padded, fit in twice its tokens when its
# sequences are of similar length; others run eagerly).
DEFAULT_PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)


def capture_or_run_eagerly(capture: Callable[[], None], drop: Callable[[], None], what: str) -> str | None:
    """Run ``capture``; on any failure call ``drop`` (forget partial graphs, clean scratch) and
    warn. Returns the error text, None when the capture worked: the caller then replays, else
    runs the same static code eagerly."""
    try:
        capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly instead
        error = f"{type(exc).__name__}: {exc}"
        torch.cuda.synchronize()
        drop()
        warnings.warn(f"{what} capture failed, running eagerly: {error}", stacklevel=3)
        return error
    return None


class _Static:
    """The static input/output buffers of one (bucket, tokens) graph."""

    def __init__(
        self, bucket: int, tokens: int, max_blocks: int, scratch: list[int], block_size: int,
        hidden_size: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        n = bucket * tokens
        self.bucket, self.tokens = bucket, tokens
        pad_table = torch.full((max_blocks,), -1, dtype=torch.int32)
        pad_table[: len(scratch)] = torch.tensor(scratch, dtype=torch.int32)
        pad_slots = torch.tensor(
            [scratch[j // block_size] * block_size + j % block_size for j in range(tokens)]
        )
        self.scratch0 = scratch[0]
        self.pad_slots_host = pad_slots  # [tokens] scratch slots of the padding rows
        self.pad_positions_host = torch.arange(tokens)  # [tokens]
        self.pad_mask_host = torch.ones(tokens, tokens, dtype=torch.bool).tril()  # [tokens, tokens]
        # Pristine padding values, copied over the unused sequences before every replay.
        self.pad_table = pad_table.to(device)
        self.pad_slots = pad_slots.to(device)
        self.pad_positions = torch.arange(tokens, device=device)
        # ids, positions and slots are the rows of one buffer: a decode step loads them in one
        # copy from the host (``load_decode``).
        self.id_pos_slot = torch.stack([
            torch.zeros(n, dtype=torch.long, device=device), self.pad_positions.repeat(bucket),
            self.pad_slots.repeat(bucket),
        ])  # [3, n]  # fmt: skip
        self.ids, self.positions, self.slots = self.id_pos_slot.unbind(0)  # [n] each
        self.tables = self.pad_table.repeat(bucket, 1)  # [bucket, max_blocks]
        self.ctx = torch.zeros(bucket, dtype=torch.int32, device=device)  # [bucket]
        self.starts = (torch.arange(bucket + 1, device=device) * tokens).to(torch.int32)
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        self.pad_mask = causal
        self.mask = causal.repeat(bucket, 1)  # [n, tokens]
        self.out = torch.zeros(n, hidden_size, dtype=dtype, device=device)  # [n, H]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.padded_from = 0  # sequences from here on hold the padding's values
        # The block tables ``load_decode`` left: per row, the sequence's block list (the list
        # itself, held, so that no later list at a reused address can pass for it) and how many
        # of its blocks the row holds, then -1s. Any other load forgets them.
        self._table_lists: list[list[int]] = []
        self._table_widths: list[int] = []

    def batch(self) -> AttentionBatch:
        return AttentionBatch(self.positions, self.slots, self.tables, self.ctx, self.starts, self.mask)

    def forget_loads(self) -> None:
        """Trust nothing an earlier load left (a load cut short by a failed step)."""
        self._table_lists, self._table_widths = [], []
        self.padded_from = self.bucket

    def load(self, ids: torch.Tensor, batch: AttentionBatch, num_seqs: int) -> None:
        n, t = ids.shape[0], self.tokens
        width = batch.block_tables.shape[1]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.tables[:num_seqs, :width].copy_(batch.block_tables)
        self.tables[:num_seqs, width:].fill_(-1)
        self._table_lists, self._table_widths = [], []
        self.ctx[:num_seqs].copy_(batch.ctx_lens)
        self.mask[:n].copy_(batch.new_mask[:, :t])
        self._pad_unused(num_seqs)

    def _pad_unused(self, num_seqs: int) -> None:
        """Sequences ``num_seqs ..`` of the bucket become dummies over the scratch block. Those
        already padding since an earlier load (nothing but loads writes the inputs) are left
        as they are: a steady batch pads nothing."""
        end = self.padded_from
        if num_seqs < end:
            n, count = num_seqs * self.tokens, end - num_seqs
            stop = end * self.tokens
            self.ids[n:stop].zero_()
            self.positions[n:stop].copy_(self.pad_positions.repeat(count))
            self.slots[n:stop].copy_(self.pad_slots.repeat(count))
            self.tables[num_seqs:end].copy_(self.pad_table.expand(count, -1))
            self.ctx[num_seqs:end].zero_()
            self.mask[n:stop].copy_(self.pad_mask.repeat(count, 1))
        self.padded_from = num_seqs

    def load_decode(self, tokens: list[int], blocks: list[list[int]], widths: list[int],
                    contexts: list[int], block_size: int) -> None:
        """One new token per sequence (``tokens[i]`` at position ``contexts[i]``, its context
        length, over the first ``widths[i]`` of its blocks ``blocks[i]``), written straight into
        the inputs: ids, positions and slots in one copy, the block tables only where they
        changed (``_load_tables``), the context lengths copied from the positions on the device
        (a one-row sequence's mask is always set). ``load`` of a ``build_batch`` made seven
        copies to the device and eight more into the inputs."""
        b = len(tokens)
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, p in zip(blocks, contexts, strict=True)]  # fmt: skip
        host = int_tensor(tokens + contexts + slots).view(3, b)  # [3, b]
        copy_to_device(self.id_pos_slot[:, :b], host)
        self._load_tables(blocks, widths)
        self.ctx[:b].copy_(self.positions[:b])
        self._pad_unused(b)

    def _load_tables(self, blocks: list[list[int]], widths: list[int]) -> None:
        """Rows ``0 .. len(blocks)`` of the block tables: row ``i`` the first ``widths[i]`` of
        ``blocks[i]``, then -1s. Only the rows that differ from what the last ``load_decode``
        left are written (a sequence's block list only grows, so the same list at the same width
        is the same row): in a steady batch a row changes once every ``block_size`` steps. With
        every row rebuilt, a load of 256 sequences took 420 us of host time at 1,000-token
        contexts on a 2-core CPU, against 81 us (157 against 64 at 64 tokens;
        ``scripts/decode_load_cost.py``)."""
        b = len(blocks)
        n = min(b, len(self._table_lists))
        same = map(operator.and_, map(operator.is_, self._table_lists, blocks[:n]),
                   map(operator.eq, self._table_widths, widths[:n]))  # fmt: skip
        stale = [*itertools.compress(range(n), map(operator.not_, same)), *range(n, b)]
        self._table_lists, self._table_widths = list(blocks), list(widths)
        if not stale:
            return
        full = self.tables.shape[1]
        if len(stale) == b:
            width_all = max(widths)
            copy_to_device(self.tables[:b, :width_all],
                           int_table([t[:w] for t, w in zip(blocks, widths, strict=True)], width_all, -1))
            if width_all < full:
                self.tables[:b, width_all:].fill_(-1)
            return
        rows = int_table([blocks[i][: widths[i]] for i in stale], full, -1)  # [len(stale), full]
        index = to_device(int_tensor(stale), self.tables.device)
        self.tables.index_copy_(0, index, to_device(rows, self.tables.device))

    def load_padded(self, rows: list[SeqRows], block_size: int) -> None:
        """Prefill rows (each at most ``tokens`` new tokens, no per-query limits) padded to the
        shape: sequence ``i`` owns rows ``i * tokens ...``; its padding rows take token 0, the
        position of its last real token, scratch slots, and a mask row over its real tokens.

        Slots, positions and masks are computed for the whole shape at once from each row's
        context and length (a prefill's rows are consecutive positions under a causal mask);
        a row that is not is written as given. Built row by row in Python, a chunk of 64
        prompts of 64 tokens took 4 ms of host time on a 2-core CPU."""
        t, b = self.tokens, len(rows)
        width = self.tables.shape[1]
        ids: list[int] = []
        for r in rows:
            ids += r.token_ids
            ids += [0] * (t - len(r.token_ids))
        # The attention walks keys up to ctx + T through the table (the padding's keys are
        # masked, but loaded): a scratch block beyond the sequence's own keeps reads in bounds.
        table = int_table([r.block_ids for r in rows], width, self.scratch0)  # [b, width]
        n = torch.tensor([len(r.token_ids) for r in rows])[:, None]  # [b, 1]
        ctx = torch.tensor([r.ctx_len for r in rows])[:, None]  # [b, 1]
        j = self.pad_positions_host  # [t]
        real = j < n  # [b, t]
        entry = ctx + torch.minimum(j, n - 1)  # [b, t] cache entry of a real row; the last one's
        blocks = table.gather(1, entry // block_size).long()  # [b, t]
        slots = torch.where(real, blocks * block_size + entry % block_size, self.pad_slots_host)  # [b, t]
        # Real rows see the real rows up to themselves, padding rows all real rows.
        mask = torch.where(real[:, :, None], self.pad_mask_host, j < n[:, :, None])  # [b, t, t]
        for i, r in enumerate(rows):  # anything but a plain prefill row is written as given
            k = len(r.token_ids)
            if r.positions != list(range(r.ctx_len, r.ctx_len + k)):
                entry[i] = torch.tensor(r.positions + [r.positions[-1]] * (t - k))
            if k > 1 and not torch.equal(r.mask, self.pad_mask_host[:k, :k]):
                mask[i, :k, :k] = r.mask
        n_all = b * t
        self._table_lists, self._table_widths = [], []  # the tables below are not ``load_decode``'s
        copy_to_device(self.ids[:n_all], int_tensor(ids))
        copy_to_device(self.positions[:n_all], entry.flatten())
        copy_to_device(self.slots[:n_all], slots.flatten())
        copy_to_device(self.tables[:b], table)
        copy_to_device(self.ctx[:b], ctx.flatten().to(torch.int32))
        copy_to_device(self.mask[:n_all], mask.view(n_all, t))
        self._pad_unused(b)


class StaticTargetForward:
    """Runs ``model.forward_target`` through static, padded shapes (CUDA graphs on GPU)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        pool: BlockPool,
        token_counts: tuple[int, ...],
        max_blocks: int,
        max_batch: int,
        use_graphs: bool,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        prefill_tokens: tuple[int, ...] = (),
        prefill_chunk: int = 0,
    ) -> None:
        self.model = model
        self.pool = pool
        self.max_blocks = max_blocks
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (1,)
        self.token_counts = tuple(sorted(set(token_counts)))
        self.use_graphs = use_graphs and pool.kv_cache.is_cuda
        shapes = {(b, t) for b in self.buckets for t in self.token_counts}
        # Prefill shapes: (bucket, T) of at most twice the prefill chunk's rows, and no longer
        # than a block table holds (a short context never has longer chunks).
        longest = max_blocks * pool.block_size
        self.prefill_shapes = sorted(
            (b, t) for b in self.buckets for t in set(prefill_tokens)
            if b * t <= 2 * prefill_chunk and t <= longest
        )  # fmt: skip
        shapes.update(self.prefill_shapes)
        max_tokens = max(t for _, t in shapes)
        self.scratch = pool.allocate(-(-max_tokens // pool.block_size), BlockOwner("graph-padding"))
        self._scratch_index = torch.tensor(self.scratch, device=pool.kv_cache.device)
        dtype = next(model.parameters()).dtype
        self._static = {
            (b, t): _Static(b, t, max_blocks, self.scratch, pool.block_size,
                            model.config.hidden_size, dtype, pool.kv_cache.device)
            for b, t in shapes
        }  # fmt: skip
        self._mempool: object | None = None
        self.capture_error: str | None = None
        if self.use_graphs:
            self.capture_error = capture_or_run_eagerly(self._capture_all, self._drop_graphs,
                                                        "CUDA graph")
            self.use_graphs = self.capture_error is None

    def _drop_graphs(self) -> None:
        for st in self._static.values():
            st.graph = None
        self._zero_scratch()

    def _bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def reset(self) -> None:
        """Back to rest after a failed engine step: no block table is taken as already loaded,
        every unused row is padded again at its next load, the scratch blocks are zeroed."""
        for st in self._static.values():
            st.forget_loads()
        self._zero_scratch()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Largest graphs first so smaller ones reuse their memory pool.
        for key in sorted(self._static, key=lambda k: (k[0] * k[1], k), reverse=True):
            st = self._static[key]
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (Triton autotune/compile) outside the capture
                    st.out.copy_(self.model.forward_target(st.ids, st.batch(), self.pool.kv_cache))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                st.out.copy_(self.model.forward_target(st.ids, st.batch(), self.pool.kv_cache))
            graph.replay()  # the first replay uploads the graph: not in a served step
            st.graph = graph
        self._zero_scratch()

    def _zero_scratch(self, tokens: int | None = None) -> None:
        """Zero the scratch blocks, or only those a shape of ``tokens`` rows per sequence writes
        (its padding slots; the 512-token prefill shapes made the scratch 32 blocks of 16,
        where a decode step's padding fills 3)."""
        index = self._scratch_index
        if tokens is not None:
            index = index[: -(-tokens // self.pool.block_size)]
        self.pool.kv_cache.index_fill_(1, index, 0)

    def eligible(self, ids: torch.Tensor, batch: AttentionBatch, tokens_per_seq: int | None) -> bool:
        """Whether the batch fits a captured shape. ``tokens_per_seq``: the caller's count of new
        tokens per sequence when every sequence has the same (None: they differ), so that no
        device value is read here."""
        num_seqs = batch.ctx_lens.shape[0]
        if batch.query_ctx_lens is not None or batch.block_tables.shape[1] > self.max_blocks:
            return False
        if num_seqs == 0 or tokens_per_seq is None or ids.shape[0] != num_seqs * tokens_per_seq:
            return False
        if tokens_per_seq not in self.token_counts or self._bucket(num_seqs) is None:
            return False
        return batch.new_mask.shape[1] == tokens_per_seq

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Hidden states [N, H] for an eligible batch (see ``eligible``)."""
        num_seqs = batch.ctx_lens.shape[0]
        tokens = ids.shape[0] // num_seqs
        bucket = self._bucket(num_seqs)
        assert bucket is not None
        st = self._static[(bucket, tokens)]
        st.load(ids, batch, num_seqs)
        if st.graph is not None:
            st.graph.replay()
        else:
            st.out.copy_(self.model.forward_target(st.ids, st.batch(), self.pool.kv_cache))
        if bucket > num_seqs:
            self._zero_scratch(tokens)  # padding rows wrote there: no stale entries left behind
        return st.out[: ids.shape[0]].clone()

    def decode_fits(self, num_seqs: int, width: int) -> bool:
        """Whether ``run_decode`` takes ``num_seqs`` sequences with block tables ``width`` wide."""
        return 1 in self.token_counts and self._bucket(num_seqs) is not None and 0 < width <= self.max_blocks

    @torch.inference_mode()
    def run_decode(self, tokens: list[int], blocks: list[list[int]], widths: list[int],
                   contexts: list[int]) -> torch.Tensor:
        """Hidden states [B, H] of an autoregressive step (see ``_Static.load_decode``): the same
        forward as ``run`` over ``build_batch``'s inputs, with less host work."""
        b = len(tokens)
        bucket = self._bucket(b)
        assert bucket is not None
        st = self._static[(bucket, 1)]
        st.load_decode(tokens, blocks, widths, contexts, self.pool.block_size)
        if st.graph is not None:
            st.graph.replay()
        else:
            st.out.copy_(self.model.forward_target(st.ids, st.batch(), self.pool.kv_cache))
        if bucket > b:
            self._zero_scratch(1)  # padding rows wrote there: no stale entries left behind
        return st.out[:b].clone()

    # ---- prefill chunks, padded to a captured shape ----
    def prefill_shape(self, rows: list[SeqRows]) -> tuple[int, int] | None:
        """The smallest captured (bucket, T) that holds these prefill rows, or None (eager)."""
        if not rows or any(r.query_ctx_lens is not None for r in rows):
            return None
        longest = max(len(r.token_ids) for r in rows)
        fits = [(b * t, b, t) for b, t in self.prefill_shapes if b >= len(rows) and t >= longest]
        if not fits:
            return None
        _, bucket, tokens = min(fits)
        # Every key position the padded rows walk (up to ctx + T) must lie in the table.
        if any(-(-(r.ctx_len + tokens) // self.pool.block_size) > self.max_blocks for r in rows):
            return None
        return bucket, tokens

    @torch.inference_mode()
    def run_prefill(self, rows: list[SeqRows], shape: tuple[int, int]) -> torch.Tensor:
        """Hidden states [N, H] of the prefill rows (``prefill_shape``'s shape), in row order."""
        st = self._static[shape]
        st.load_padded(rows, self.pool.block_size)
        if st.graph is not None:
            st.graph.replay()
        else:
            st.out.copy_(self.model.forward_target(st.ids, st.batch(), self.pool.kv_cache))
        t = st.tokens
        self._zero_scratch(t)  # padding rows wrote there: no stale entries left behind
        keep = [i * t + j for i, r in enumerate(rows) for j in range(len(r.token_ids))]
        # Unsynchronised: a blocking copy would wait for the prefill just queued (~6 ms of host
        # time at a 64-prompt chunk on the H200).
        index = to_device(int_tensor(keep), st.out.device)  # [N]
        return st.out[index]  # [N, H], a copy (a gather)
