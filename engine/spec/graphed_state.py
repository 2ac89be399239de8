"""The graphed tree step's per-step state (``engine.spec.graphed_tree``): each batch bucket's
static buffers, a step queued on the device and not yet read, what a step leaves its sequences
(their MTP rows deferred to its outputs), and its outcome as the engine reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from engine.sequence import Sequence
from engine.spec.acceptance_stats import AcceptanceCounter

if TYPE_CHECKING:
    from engine.spec.graphed_tree import GraphedTreeStep

SMALL_BATCH = 8  # StepResults.chain_tokens counts this many rows or fewer in Python


@dataclass
class StepResults:
    """One step's outcome for its ``n`` sequences, in batch order (the packed output rows)."""

    tokens: list[list[int]]  # [n] the accepted draft tokens, then the bonus token
    num_accepted: list[int]  # [n] accepted draft tokens
    has_child: np.ndarray  # [n, D + 1] the path's node at depth j had children (read for j <= a)
    ranks: np.ndarray  # [n, D + 1] sibling rank of the path's node at depth j (1 <= j <= a)

    def record_acceptance(self, counter: AcceptanceCounter, width: int) -> None:
        """Count the step's paths; ``width``: the children a node with children had at most
        (the budget's top-k; the graphed trees are full to it but for pruned nodes)."""
        counter.record_paths(self.num_accepted, self.has_child, self.ranks, width)

    def chain_tokens(self, depth: int) -> int:
        """Tokens a chain of ``depth`` drafts would have produced over these sequences: each
        accepted path's leading run of rank-0 nodes (the chain drafts each depth's best child
        of the previous best child, the tree's rank 0), at most ``depth``, plus the bonus.
        Exact when the tree kept that run's nodes; it keeps the best ones by score."""
        cols = min(depth, self.ranks.shape[1] - 1)
        n = len(self.num_accepted)
        if n <= SMALL_BATCH:  # a few rows: plain Python beats five numpy calls
            total = n
            for row, a in zip(self.ranks[:, 1 : cols + 1].tolist(), self.num_accepted, strict=True):
                for rank in row[: min(a, cols)]:
                    if rank:
                        break
                    total += 1
            return total
        first = self.ranks[:, 1 : cols + 1] == 0  # [n, cols] the path node at depth j is rank 0
        accepted = np.arange(1, cols + 1)[None] <= np.asarray(self.num_accepted)[:, None]
        return int(np.cumprod(first & accepted, axis=1).sum()) + n


@dataclass
class SteadyRows:
    """What one step's ``_finish`` left its sequences: their pending MTP rows, deferred to this
    object (``Sequence.deferred`` is ``refs[i]``; ``hidden_of``: the first ``a_i + 1`` rows of
    ``next_rows[i]`` [P, H] for module 1, and ``next_carry[i]``'s row of each deeper depth), and
    ``committed[i]`` its ``num_committed``. ``fits``: every sequence has the blocks for one
    more step; ``variant``: the device-program variant the step ran."""

    seqs: tuple[Sequence, ...]
    next_rows: Tensor  # [n, P, H]
    next_carry: Tensor  # [n, k - 1, H]
    num_accepted: list[int]
    committed: list[int]
    fits: bool
    variant: bool
    refs: list[tuple[SteadyRows, int]] = field(default_factory=list)
    checked: list[Sequence] | None = None  # the batch ``holds`` last confirmed
    _index: dict[int, int] | None = None  # id(sequence) -> its row (``rows_of``)

    def hidden_of(self, index: int) -> list[Tensor]:
        """Sequence ``index``'s pending rows per depth: [a + 1, H], then [1, H] per deeper one."""
        a = self.num_accepted[index]
        carry = self.next_carry[index]  # [k - 1, H]
        return [self.next_rows[index, : a + 1], *(carry[d : d + 1] for d in range(carry.shape[0]))]

    def holds(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` are these sequences in this order, each with exactly the state the
        step left: no token committed, no MTP row read, consumed, truncated or appended since
        (any access to the deferred rows hands them out, which clears ``deferred``), and room
        for one more step. Then every sequence is eligible and the bucket's inputs, advanced on
        the device (``GraphedTreeStep._advance``), are this batch's."""
        if not self.fits or len(seqs) != len(self.seqs):
            return False
        if any(a is not b for a, b in zip(seqs, self.seqs, strict=True)):
            return False
        for s, ref, L in zip(seqs, self.refs, self.committed, strict=True):
            if s.deferred is not ref or s.num_committed != L or len(s.tokens) != L + 1:
                return False
        self.checked = seqs
        return True

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row in this step's batch where it is untouched since (as ``holds``
        asks of every one), else -1: the part of the batch still decoding after others finished,
        whose inputs the last step advanced on the device (``GraphedTreeStep._gather_inputs``)."""
        if not self.fits:  # a sequence may need more blocks: every one is checked (``eligible``)
            return [-1] * len(seqs)
        if self._index is None:
            self._index = {id(s): i for i, s in enumerate(self.seqs)}
        rows = []
        for s in seqs:
            i = self._index.get(id(s), -1)
            if i >= 0:
                L = self.committed[i]
                if s.deferred is not self.refs[i] or s.num_committed != L or len(s.tokens) != L + 1:
                    i = -1
            rows.append(i)
        return rows


@dataclass
class StepLaunch:
    """A step queued on the device and not yet read: its bucket, its batch in row order, each
    row's catch-up count ``c``, the host copy of its packed outputs and the event that copy
    records, copies of its next-step MTP rows, its rollback timing and program variant."""

    buf: BucketBuffers
    seqs: list[Sequence]
    c: list[int]
    packed: Tensor  # [bucket, 2 + 3P] pinned host copy
    copied: Any  # torch.cuda.Event | None
    next_rows: Tensor  # [n, P, H]
    next_carry: Tensor  # [n, k - 1, H]
    timing: tuple[object, ...]
    variant: bool


class BucketBuffers:
    """Static inputs and outputs of one batch bucket."""

    def __init__(self, bucket: int, g: GraphedTreeStep) -> None:
        dev, H, C, D = g.device, g.hidden_size, g.C, g.D
        self.bucket = bucket
        self.tables = torch.full((bucket, g.max_blocks), -1, dtype=torch.int32, device=dev)
        self.L = torch.zeros(bucket, dtype=torch.long, device=dev)  # target committed = root index
        self.c = torch.ones(bucket, dtype=torch.long, device=dev)  # catch-up rows per module
        self.live = torch.zeros(bucket, dtype=torch.bool, device=dev)  # rows of real sequences
        self.tail = torch.zeros(bucket, C, dtype=torch.long, device=dev)  # catch-up tokens
        self.rows0 = torch.zeros(bucket, C, H, dtype=g.dtype, device=dev)  # module 1 inputs
        self.carry = torch.zeros(bucket, max(g.k - 1, 0), H, dtype=g.dtype, device=dev)
        # Sampling parameters per sequence (sampled trees only; padding rows sample at T = 1).
        self.temperature = torch.ones(bucket, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(bucket, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(bucket, dtype=torch.float32, device=dev)
        # Outputs.
        P = D + 1
        self.packed = torch.zeros(bucket, 2 + 3 * P, dtype=torch.long, device=dev)
        # Its host copies (pinned on a GPU: asynchronous copies, each waited for by its event),
        # two in turn: a step launched ahead (``GraphedTreeStep.run``) copies its outputs while
        # the host still reads the last step's.
        cuda = dev.type == "cuda"
        self.packed_hosts = [torch.zeros(bucket, 2 + 3 * P, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.copy_events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.next_host = 0
        self.next_rows = torch.zeros(bucket, P, H, dtype=g.dtype, device=dev)
        self.next_carry = torch.zeros_like(self.carry)
        # The rollback's inputs: each tree's slots, its accepted path and which depths it kept.
        self.tree_slots = torch.zeros(bucket, g.N + 1, dtype=torch.long, device=dev)
        self.path = torch.zeros(bucket, P, dtype=torch.long, device=dev)
        self.keep = torch.zeros(bucket, P, dtype=torch.bool, device=dev)
        # Every MTP forward's slots to zero ([B * R] each, forward after forward) and the cache
        # layer of each: the step zeroes them all at once after its last drafting depth.
        self.draft_zero = torch.zeros(sum(bucket * p.rows for p in g.plans), dtype=torch.long, device=dev)
        self.draft_zero_parts = self.draft_zero.split([bucket * p.rows for p in g.plans])
        self.draft_zero_layer = torch.tensor(
            [g.model.mtp_cache_layer(p.module) for p in g.plans for _ in range(bucket * p.rows)],
            dtype=torch.long, device=dev,
        )  # fmt: skip
        rows = {p.rows for p in g.plans} | {g.N + 1}
        self.query_start = {  # rows per sequence -> [bucket + 1] int32 offsets
            r: (torch.arange(bucket + 1, device=dev) * r).to(torch.int32) for r in rows
        }
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # step variant -> draft/verify/accept
        self.rollback_graph: torch.cuda.CUDAGraph | None = None
        self.advance_graph: torch.cuda.CUDAGraph | None = None
        # The last step's sequences and the MTP rows it handed them (``SteadyRows``), while it
        # is the runner's last step: the next step over the same sequences, untouched since,
        # loads nothing (``_advance``); over some of them, gathers their rows on the device.
        self.steady: SteadyRows | None = None

    def set_padding(self, start: int, g: GraphedTreeStep) -> None:
        """Rows ``start:`` become dummy sequences living in the scratch blocks."""
        self.live.copy_(g.live_rows[self.bucket][start])
        self.tables[start:] = g.pad_table
        self.L[start:] = g.k
        self.c[start:] = 1
        self.tail[start:] = 0
        self.temperature[start:] = 1.0
        self.top_k[start:] = 0
        self.top_p[start:] = 1.0
