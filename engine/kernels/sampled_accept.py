"""Fused Triton kernel for ``engine.spec.device_tree.accept_sampled_torch``: one launch, all trees.

Multi-draft recursive rejection sampling (SpecInfer; children drawn without replacement, see
``accept_sampled_torch``) walks each tree from the root: at every depth the current node's
children are tried in draw order, each rejection replacing the target law ``p`` by its residual
``max(p - q, 0)`` and removing the draw from ``q``. In PyTorch that is ~15 small kernels per
(depth, sibling), ~300 per step for the default sampled shape, each over ``[B, V]``. Here grid
``(B,)``: program ``b`` walks tree ``b``, keeping the current ``p`` and ``q`` unnormalised in two
``[V]`` rows of a workspace with their masses as scalars, so a rejection is one pass over the
vocabulary to find the residual's mass and one to write it (a barrier orders the passes: a
later scalar read may fall on another thread's element). Passes run only where they change
something (a rejection, an acceptance, a walk still going): on the H200 the kernel that ran
them all, masked, took 85 us of a sampled chain-6 step at batch 128, its serial passes over the
vocabulary latency-bound.

The randomness is an input, as in ``accept_sampled_torch``: ``uniforms`` ``[B, D, W]`` (the
acceptance test of sibling ``r`` at depth ``d``) and ``noise`` ``[B, V]`` (exponentials: the bonus
token is ``argmax p / noise``, a draw from ``p``). Given the same inputs both versions take the
same decisions up to float rounding (the torch version renormalises after every step).

Outputs: accepted count ``[B]``, path ``[B, D + 1]`` (root first; entries past the count repeat
the deepest accepted node), bonus token ``[B]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _accept_sampled_kernel(
    tok_ptr, valid_ptr,  # [B, n] int64, [B, n] uint8
    p_ptr, q_ptr,  # [B, n, V], [B, I, V] float32 target laws per node, draft laws per internal node
    child_ptr, qrow_ptr,  # [n, W] int64 children in draw order (-1 padded), [n] int64 draft-law row
    u_ptr, e_ptr,  # [B, D, W] uniforms, [B, V] exponentials
    pw_ptr, qw_ptr,  # [B, V] float32 workspace: the current p and q, unnormalised
    num_ptr, path_ptr, bonus_ptr,  # [B], [B, D + 1], [B] int64 outputs
    n, num_internal, V,
    DEPTH: tl.constexpr, WIDTH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    pw = pw_ptr + b * V
    qw = qw_ptr + b * V
    zero_f = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), axis=0)  # float32 scalar 0
    cur = b * 0  # int64 scalar: the root
    for v0 in range(0, V, BLOCK_V):  # p <- p_all[b, root]
        m = v0 + offs < V
        tl.store(pw + v0 + offs, tl.load(p_ptr + b * n * V + v0 + offs, mask=m, other=0.0), mask=m)
    pmass = zero_f + 1.0
    done = cur  # 0 while the walk goes on
    num = cur
    tl.store(path_ptr + b * (DEPTH + 1), cur)
    for level in tl.static_range(DEPTH):
        if done == 0:  # (uniform per program: the branches skip whole passes over the vocabulary)
            row = tl.load(qrow_ptr + cur)
            for v0 in range(0, V, BLOCK_V):  # q <- the law cur's children were drawn from
                m = v0 + offs < V
                q = tl.load(q_ptr + (b * num_internal + row) * V + v0 + offs, mask=m, other=0.0)
                tl.store(qw + v0 + offs, q, mask=m)
            qmass = zero_f + 1.0
            tl.debug_barrier()
            moved = cur * 0
            nxt = cur
            for r in tl.static_range(WIDTH):
                child = tl.load(child_ptr + cur * WIDTH + r)
                safe = tl.maximum(child, 0)
                x = tl.load(tok_ptr + b * n + safe)
                ok = tl.load(valid_ptr + b * n + safe)
                tried = (moved == 0) & (child >= 0) & (ok != 0)
                px = tl.load(pw + x) / pmass
                qx_raw = tl.load(qw + x)
                u = tl.load(u_ptr + (b * DEPTH + level) * WIDTH + r)
                accept = tried & (u * (qx_raw / qmass) < px)
                moved = tl.where(accept, 1, moved)
                nxt = tl.where(accept, safe, nxt)
                if tried & (u * (qx_raw / qmass) >= px):  # rejected: p <- the residual, q <- q without x
                    mass = zero_f
                    for v0 in range(0, V, BLOCK_V):  # the residual's mass
                        m = v0 + offs < V
                        rest = tl.load(pw + v0 + offs, mask=m, other=0.0) / pmass - \
                            tl.load(qw + v0 + offs, mask=m, other=0.0) / qmass
                        mass += tl.sum(tl.where(m, tl.maximum(rest, 0.0), 0.0), axis=0)
                    if mass > 0:  # no mass in floating point: p stays (as the host does)
                        for v0 in range(0, V, BLOCK_V):  # each chunk read before written
                            m = v0 + offs < V
                            rest = tl.load(pw + v0 + offs, mask=m, other=0.0) / pmass - \
                                tl.load(qw + v0 + offs, mask=m, other=0.0) / qmass
                            tl.store(pw + v0 + offs, tl.maximum(rest, 0.0), mask=m)
                        pmass = mass
                    q_left = qmass - qx_raw
                    tl.debug_barrier()
                    if q_left > 0:  # the next draw's law
                        tl.store(qw + x, zero_f)
                        qmass = q_left
                    tl.debug_barrier()
            done = tl.where(moved == 0, 1, done)
            num += moved
            cur = nxt
            if moved != 0:  # p <- the target law after the accepted child
                for v0 in range(0, V, BLOCK_V):
                    m = v0 + offs < V
                    tl.store(pw + v0 + offs, tl.load(p_ptr + (b * n + cur) * V + v0 + offs, mask=m, other=0.0),
                             mask=m)  # fmt: skip
                pmass = zero_f + 1.0
                tl.debug_barrier()
        tl.store(path_ptr + b * (DEPTH + 1) + level + 1, cur)
    best = zero_f - 1.0
    best_at = cur * 0
    for v0 in range(0, V, BLOCK_V):  # bonus: an exponential race over the final law
        m = v0 + offs < V
        key = tl.load(pw + v0 + offs, mask=m, other=0.0) / tl.load(e_ptr + b * V + v0 + offs, mask=m, other=1.0)
        key = tl.where(m, key, -1.0)
        top = tl.max(key, axis=0)
        at = tl.argmax(key, axis=0).to(tl.int64) + v0
        better = top > best
        best = tl.where(better, top, best)
        best_at = tl.where(better, at, best_at)
    tl.store(num_ptr + b, num)
    tl.store(bonus_ptr + b, best_at)


def accept_sampled_triton(
    tokens: Tensor,  # [B, n] int64 node tokens (root first)
    valid: Tensor,  # [B, n] bool
    p_all: Tensor,  # [B, n, V] float32 normalised target laws
    q_all: Tensor,  # [B, I, V] float32 normalised draft laws
    children: Tensor,  # [n, W] int64, -1 padded
    q_row: Tensor,  # [n] int64
    uniforms: Tensor,  # [B, D, W] float32
    noise: Tensor,  # [B, V] float32 exponentials (> 0)
    block_v: int = 1024,
) -> tuple[Tensor, Tensor, Tensor]:  # accepted [B], path [B, D + 1], bonus [B]
    B, n, V = p_all.shape
    depth, width = uniforms.shape[1], uniforms.shape[2]
    assert children.shape == (n, width) and q_all.shape[0] == B and q_all.shape[2] == V
    dev = p_all.device
    num = torch.empty(B, dtype=torch.long, device=dev)
    path = torch.empty(B, depth + 1, dtype=torch.long, device=dev)
    bonus = torch.empty(B, dtype=torch.long, device=dev)
    work = torch.empty(2, B, V, dtype=torch.float32, device=dev)
    _accept_sampled_kernel[(B,)](
        tokens.contiguous(), valid.contiguous().view(torch.uint8), p_all.contiguous(),
        q_all.contiguous(), children.contiguous(), q_row.contiguous(), uniforms.contiguous(),
        noise.contiguous(), work[0], work[1], num, path, bonus, n, q_all.shape[1], V,
        DEPTH=depth, WIDTH=width, BLOCK_V=min(block_v, triton.next_power_of_2(V)), num_warps=4,
    )  # fmt: skip
    return num, path, bonus
