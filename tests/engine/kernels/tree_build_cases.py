"""Random drafting depths and candidate sets for the fused tree-building kernels (growth per
depth, selection and mask, each MTP forward's attention inputs) against their torch references
(``engine.spec.device_tree``, ``engine.spec.graphed_rows.RowPlan.inputs_torch``).

Shared by the interpreter checks (CPU) and the GPU tests. Candidates are laid out as the graphed
greedy step lays them out: depth-major, each child scored below its parent. Some cases put
scores near zero and repeat values exactly, where the selection key's float64 tie-break decides.
"""

from __future__ import annotations

import torch


def _candidates(gen: torch.Generator, B: int, K: int, D: int, scale: float, repeats: bool):  # type: ignore[no-untyped-def]
    """(scores [B, T] float32, parents [B, T], tokens [B, T], depths [T]) of a depth-major
    candidate set: K children of the root, then K*K per depth below a random frontier."""
    T = K + (D - 1) * K * K
    parents = torch.full((B, T), -1, dtype=torch.long)
    depth = torch.ones(T, dtype=torch.long)
    for m in range(2, D + 1):
        start = K + (m - 2) * K * K
        prev = (0, K) if m == 2 else (K + (m - 3) * K * K, K * K)
        frontier = prev[0] + torch.stack([torch.randperm(prev[1], generator=gen)[:K] for _ in range(B)])  # [B, K]
        parents[:, start : start + K * K] = frontier.repeat_interleave(K, dim=1)
        depth[start : start + K * K] = m
    step = scale * torch.rand(B, T, generator=gen)
    if repeats:  # exact ties among siblings and across depths
        step = (step * 4).round() / 4
    scores = torch.zeros(B, T)
    for i in range(T):
        p = parents[:, i]
        base = torch.where(p >= 0, scores.gather(1, p.clamp(min=0)[:, None])[:, 0], torch.zeros(B))
        scores[:, i] = base - step[:, i]
    tokens = torch.randint(0, 1000, (B, T), generator=gen)
    return scores, parents, tokens, depth


def check_select_tree(device: str) -> tuple[float, float]:
    """0 when the fused selection (tokens, parents, depths, mask) equals ``select_tree_torch``
    on random candidate sets, 1 otherwise."""
    from engine.kernels.tree_select import select_tree_triton
    from engine.spec.device_tree import select_tree_torch, tie_breaks

    gen = torch.Generator().manual_seed(21)
    for trial in range(16):
        K, D, N = [(4, 6, 32), (3, 4, 12), (1, 5, 5), (2, 3, 4), (8, 3, 40)][trial % 5]
        scale, repeats = [(1.0, False), (1e-8, False), (1.0, True), (1e-3, False)][trial % 4]
        scores, parents, tokens, depth = _candidates(gen, 5, K, D, scale, repeats)
        root = torch.randint(0, 1000, (5,), generator=gen)
        args = [t.to(device) for t in (scores, parents, tokens, depth, root)]
        want = select_tree_torch(*args, N, D)
        got = select_tree_triton(args[0], tie_breaks(scores.shape[1], torch.device(device)), *args[1:], N, D)
        if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return 1.0, 0.0
    return 0.0, 0.0


def check_grow_frontier(device: str) -> tuple[float, float]:
    """0 when the fused growth of a depth equals ``grow_frontier_torch`` (scores, tokens,
    parents, the next frontier and its hidden rows, bit for bit), 1 otherwise: random scores,
    float32 and bfloat16 hidden states, frontier rows as a strided slice of a module's output."""
    from engine.kernels.tree_grow import grow_frontier_triton
    from engine.spec.device_tree import grow_frontier_torch

    gen = torch.Generator().manual_seed(23)
    for trial in range(12):
        B, K, H, C = [(3, 4, 48, 7), (1, 3, 40, 5), (5, 1, 16, 2), (2, 8, 64, 0)][trial % 4]
        dtype = torch.bfloat16 if trial % 2 else torch.float32
        front_score = -torch.rand(B, K, generator=gen) * 5
        front_idx = torch.randint(0, 50, (B, K), generator=gen)
        child_logp = torch.log_softmax(torch.randn(B, K, 100, generator=gen), -1).topk(K, -1).values
        child_tok = torch.randint(0, 1000, (B, K, K), generator=gen)
        out = torch.randn(B, C + K, H, generator=gen).to(dtype)  # a module's rows: catch-up, frontier
        args = [t.to(device) for t in (front_score, front_idx, child_logp, child_tok, out[:, C:])]
        offset = 4 + 16 * trial
        want = grow_frontier_torch(*args, offset)
        if trial % 3 == 2:  # the graphed step's layout: the frontier read from and the depth's
            # candidates written into columns of [B, T] buffers, the indices one row for all
            T = offset + K * K + 3
            buffers = [torch.zeros(B, T, dtype=dt, device=device) for dt in (torch.float32, torch.long, torch.long)]
            buffers[0][:, 1 : K + 1] = args[0]
            args[0] = buffers[0][:, 1 : K + 1]
            args[1] = args[1][:1].expand(B, K)
            want = grow_frontier_torch(*args, offset)
            cols = slice(offset, offset + K * K)
            got = grow_frontier_triton(*args, offset, out=tuple(b[:, cols] for b in buffers))  # type: ignore[arg-type]
            if not all(torch.equal(w, b[:, cols]) for w, b in zip(want[:3], buffers, strict=True)):
                return 1.0, 0.0
        else:
            got = grow_frontier_triton(*args, offset)
        if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return 1.0, 0.0
    return 0.0, 0.0


def check_mtp_rows(device: str) -> tuple[float, float]:
    """0 when the fused attention inputs of every MTP forward of a step (one launch for all
    depths) equal ``RowPlan.inputs_torch`` depth by depth, for a few step shapes (catch-up
    rows, frontier rows, reused modules, a single depth) and batch sizes."""
    from engine.kernels.mtp_rows import mtp_rows_triton, pack_row_tables
    from engine.spec.graphed_rows import META_COLUMNS, WIN, RowPlan

    gen = torch.Generator().manual_seed(29)
    for (k, D, K), B in zip([(4, 6, 4), (3, 3, 2), (1, 4, 3), (4, 2, 1), (1, 1, 1)], [5, 1, 3, 2, 4], strict=True):
        C = D + 1
        frontier = [0] + [K] * (D - 1)
        plans = [RowPlan.build(m, k, frontier[m - 1] if m <= D else 0, C, torch.device(device))
                 for m in range(1, max(D, k) + 1)]  # fmt: skip
        rows = [p.rows for p in plans]
        W = max(int(p.meta[1:, :, WIN].max()) for p in plans) + 3
        L = torch.randint(k + C, 500, (B,), generator=gen).to(device)
        c = torch.randint(1, C + 1, (B,), generator=gen).to(device)
        window = torch.randint(0, 10_000, (B, W), generator=gen).to(device)
        tables = pack_row_tables([p.meta for p in plans], [p.mask for p in plans],
                                 [p.ctx_offset for p in plans], [p.catch_up for p in plans])
        pos, slots, ctx, masks, qctx, zero = mtp_rows_triton(L, c, window, *tables, rows, 99_999,
                                                             META_COLUMNS)  # fmt: skip
        at = mask_at = 0
        for i, (plan, R) in enumerate(zip(plans, rows, strict=True)):
            want = plan.inputs_torch(L, c, window, 99_999)
            part = slice(B * at, B * (at + R))
            got = (pos[part], slots[part], ctx[i], masks[B * mask_at : B * (mask_at + R * R)].view(B * R, R),
                   qctx[part], zero[part])  # fmt: skip
            if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
                return 1.0, 0.0
            at, mask_at = at + R, mask_at + R * R
    return 0.0, 0.0
