"""A GEMM for few rows with the decoder layer's neighbours folded in: one launch each for
``norm -> linear``, ``linear -> + residual`` and ``norm -> gate/up -> silu * up``.

A drafting depth of the graphed tree step runs an MTP module (a full decoder layer) over a few
rows per sequence. Its GEMMs are latency-bound on an H200 (~3.5-4 us each at 8 rows) and so are
the small kernels between them: the RMSNorm before each projection, the residual add and the
SwiGLU product (~1.3 us each plus the gap between launches). Here they ride inside the GEMM:

- ``rms_eps``: the rows are RMS-normalised first. The norm is a per-row scale and its weight a
  per-column scale of ``weight`` (``fold_norm``, once at build), so the K loop only sums
  ``x * x`` beside the dot product (the dot's operand stays as loaded: modifying it cost the
  pipelined loads, 7 against 3.6 us on the H200) and the accumulator is scaled by
  ``rsqrt(mean(x^2) + eps)`` at the end.
- ``residual``: added to the output tile before it is stored.
- ``gated``: ``weight`` holds gate and up rows interleaved (``interleave_gate_up``); one dot
  computes both for a tile, which stores ``silu(gate) * up``.

Rounding differs from the PyTorch path (one rounding to the dtype at the store, the norm's
weight folded into the matrix), which
is why only the drafting forward uses it: a draft's numerics change which tokens are proposed,
never which are accepted. ``engine.model.draft_layer.fused_linear_torch`` is the same
computation in float32 PyTorch (the reference of the tests, and the path without a GPU), next
to ``fold_norm`` and ``interleave_gate_up``, which lay the weights out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _fused_linear_kernel(
    x_ptr, w_ptr, res_ptr, out_ptr,  # [M, K], [N or 2N, K], [M, N], [M, N]
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_ok = offs_m < M
    # Gated: the tile's weight rows are 2 * BLOCK_N interleaved (gate j, up j) rows.
    W_ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    offs_w = pid_n * W_ROWS + tl.arange(0, W_ROWS)  # [WR]
    w_ok = offs_w < (2 * N if GATED else N)
    acc = tl.zeros((BLOCK_M, W_ROWS), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + offs_w.to(tl.int64)[None, :] * stride_wn  # [1, WR]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if NORM:  # only read: the dot's operand stays as loaded
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
        w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & w_ok[None, :], other=0.0)  # [BK, WR]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if NORM:
        acc = acc * tl.rsqrt(sq / K + eps)[:, None]
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))  # [BM, BN] each
        acc = gate / (1.0 + tl.exp(-gate)) * up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    out_ok = m_ok[:, None] & (offs_n < N)[None, :]
    if RESIDUAL:
        res = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=out_ok, other=0.0)
        acc += res.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(dtype), mask=out_ok)


def _tiles(M: int, N: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the fewest row tiles, and output columns split finely enough that the
    weight (the bytes that matter at a few rows) streams through about every SM."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128
    m_tiles = triton.cdiv(M, block_m)
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) * m_tiles < sms:
        block_n //= 2
    return block_m, block_n


def fused_linear(
    x: Tensor,  # [M, K] (last dim contiguous; any row stride)
    weight: Tensor,  # [N, K], or [2N, K] gate/up rows interleaved when gated (contiguous)
    rms_eps: float | None = None,  # RMS-normalise the rows first (the norm weight folded in)
    residual: Tensor | None = None,  # [M, N] (last dim contiguous): added to the output
    gated: bool = False,  # silu(x @ gate.T) * (x @ up.T)
    *,
    block_n: int | None = None,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Tensor:  # [M, N] in x's dtype
    """``fused_linear_torch`` in one Triton launch (see the module docstring); the keywords are
    tuning knobs (``scripts/fused_linear_tune.py``), None: ``_tiles``."""
    M, K = x.shape
    rows = weight.shape[0]
    N = rows // 2 if gated else rows
    assert weight.shape[1] == K and weight.is_contiguous() and x.stride(-1) == 1
    assert not gated or rows % 2 == 0
    assert residual is None or (residual.shape == (M, N) and residual.stride(-1) == 1)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m, tile_n = _tiles(M, N, x.device)
    block_n = tile_n if block_n is None else block_n
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _fused_linear_kernel[grid](
        x, weight, residual if residual is not None else out, out,
        M, N, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), 0.0 if rms_eps is None else rms_eps,
        NORM=rms_eps is not None, RESIDUAL=residual is not None, GATED=gated,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
