"""The rows of the graphed tree step's MTP forwards (``engine.spec.graphed_tree``), laid out once.

Each drafting depth ``m`` runs one MTP forward over a fixed number of rows per sequence: ``C``
catch-up rows (the tokens committed since the module's last step, the first ``c`` valid) when
``m <= k``, then the frontier rows (the drafted nodes that get children) when ``2 <= m <= D``.
Which rows are valid, where each is written and what each may attend to depend only on ``c``, so
``RowPlan`` tabulates them for every ``c`` at start-up, and a step turns the tables into its
attention inputs with one gather per depth (``RowPlan.inputs_torch``, or the fused kernel
``engine.kernels.mtp_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

# Columns of ``RowPlan.meta``: position minus L, window index, query context as ctx * on + off,
# kept (committed) row.
POS, WIN, QON, QOFF, KEEP = META_COLUMNS = (0, 1, 2, 3, 4)


class RowInputs(NamedTuple):
    """One MTP forward's attention inputs (``RowPlan.inputs``), rows sequence-major."""

    positions: Tensor  # [B * R] int64
    slots: Tensor  # [B * R] int64 flat cache slots
    ctx_lens: Tensor  # [B] int32 module entries before the rows
    new_mask: Tensor  # [B * R, R] bool rows' mask among themselves
    query_ctx_lens: Tensor  # [B * R] int32 context each row may see
    zero: Tensor  # [B * R] int64 slots to zero after the forward (the trash slot for kept rows)


@dataclass
class RowPlan:
    """The rows of one MTP forward of the step (depth ``m``), precomputed for every ``c``.

    Rows: ``C`` catch-up rows (tokens committed since the module's last step, the first ``c``
    valid) when ``m <= k``, then ``F`` frontier rows (the drafted nodes of depth ``m - 1`` that
    get children) when ``2 <= m <= D``. ``meta[c, r]`` holds, for row ``r`` when ``c`` catch-up rows are valid: its
    position minus ``L``, its index in the step's slot window (positions ``L - k - C + 1 + w``),
    the query context as ``ctx * on + off``, and whether the row is committed (kept in the cache).
    ``mask[c]`` is the rows' mask among themselves. The module's committed entries before the
    rows: ``ctx = L - c + ctx_offset`` with catch-up rows, ``L + ctx_offset`` without.
    """

    module: int
    catch_up: bool
    frontier: bool
    ctx_offset: int
    meta: Tensor  # [C + 1, R, 5] long
    mask: Tensor  # [C + 1, R, R] bool

    @property
    def rows(self) -> int:
        return self.meta.shape[1]

    def ctx(self, L: Tensor, c: Tensor) -> Tensor:  # [B] committed module entries
        return L - c + self.ctx_offset if self.catch_up else L + self.ctx_offset

    def inputs_torch(self, L: Tensor, c: Tensor, window: Tensor, trash: int) -> RowInputs:
        """This forward's attention inputs for sequences at ``L`` with ``c`` catch-up rows
        (``window`` [B, W]: the flat slots of the step's positions window), and the slots to
        zero after it: the reference of the fused kernel (``GraphedTreeStep._row_inputs``)."""
        B, R = window.shape[0], self.rows
        meta = self.meta.index_select(0, c)  # [B, R, 5] this step's row layout
        ctx = self.ctx(L, c)  # [B]
        slots = window.gather(1, meta[..., WIN])  # [B, R]
        return RowInputs(
            positions=(L[:, None] + meta[..., POS]).reshape(-1),
            slots=slots.reshape(-1),
            ctx_lens=ctx.to(torch.int32),
            new_mask=self.mask.index_select(0, c).reshape(B * R, R),
            query_ctx_lens=(ctx[:, None] * meta[..., QON] + meta[..., QOFF]).reshape(-1).to(torch.int32),
            zero=torch.where(meta[..., KEEP].bool(), trash, slots).reshape(-1),
        )

    @classmethod
    def build(cls, m: int, k: int, F: int, C: int, device: torch.device) -> RowPlan:
        """Depth ``m``'s plan with ``F`` frontier rows (0: catch-up only)."""
        module = min(m, k)
        catch_up, frontier = m <= k, F > 0
        n_catch = C if catch_up else 0
        R = n_catch + F
        band = max(module - 1, 1)
        meta = torch.zeros(C + 1, R, 5, dtype=torch.long)
        mask = torch.zeros(C + 1, R, R, dtype=torch.bool)
        for c in range(1, C + 1):
            ctx_from_base = k + C - module - c if catch_up else C  # ctx - (L - k - C + 1)
            for r in range(R):
                meta[c, r, WIN] = ctx_from_base + r
                mask[c, r, r] = True
                if r < n_catch:  # catch-up row j = r
                    valid = r < c
                    meta[c, r, POS] = 1 - c + r
                    meta[c, r, QON] = int(valid)
                    meta[c, r, QOFF] = min(0, r - module + 2) if valid else 0
                    meta[c, r, KEEP] = int(valid)
                    for j in range(r - band + 1 if valid else 0):
                        mask[c, r, j] = True
                else:  # frontier row: sees the valid catch-up rows and itself
                    meta[c, r, POS] = m - 1
                    meta[c, r, QON] = 1
                    mask[c, r, :min(c, n_catch)] = True
        return cls(module, catch_up, frontier, 1 - (module if catch_up else k), meta.to(device), mask.to(device))
