"""A GEMM for few rows with the decoder layer's neighbours folded in: one launch each for
``norm -> linear``, ``linear -> + residual`` and ``norm -> gate/up -> silu * up``.

A drafting depth of the graphed tree step runs an MTP module (a full decoder layer) over a few
rows per sequence. Its GEMMs are latency-bound on an H200 (~3.5-4 us each at 8 rows) and so are
the small kernels between them: the RMSNorm before each projection, the residual add and the
SwiGLU product (~1.3 us each plus the gap between launches). Here they ride inside the GEMM:

- ``norm_weight``: the rows are RMS-normalised first. The norm is a per-row scale, so the K loop
  multiplies ``x * norm_weight`` and sums ``x * x`` alongside the dot product, and the
  accumulator is scaled by ``rsqrt(mean(x^2) + eps)`` at the end: no pass over the row before
  the loop, and no normalised copy in memory.
- ``residual``: added to the output tile before it is stored.
- ``gated``: ``weight`` holds gate rows then up rows (``[2N, K]``, as ``fuse_rows`` lays out the
  MLP's gate and up projections); the tile computes both and stores ``silu(gate) * up``.

Rounding differs from the PyTorch path (one rounding to the dtype at the store, and the norm's
weight applied before the product rather than after a rounding of the normalised row), which
is why only the drafting forward uses it: a draft's numerics change which tokens are proposed,
never which are accepted. ``fused_linear_torch`` is the same computation in float32 PyTorch
(the reference of the tests, and the path without a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _fused_linear_kernel(
    x_ptr, w_ptr, nw_ptr, res_ptr, out_ptr,  # [M, K], [N or 2N, K], [K], [M, N], [M, N]
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = offs_m < M
    n_ok = offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if NORM:
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(dtype)
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_cols + offs_k[:, None], mask=w_ok, other=0.0)  # [BK, BN]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            wu = tl.load(w_cols + N * stride_wn + offs_k[:, None], mask=w_ok, other=0.0)  # [BK, BN]
            up = tl.dot(x, wu, up, input_precision=DOT_PRECISION)
    if NORM:
        rstd = tl.rsqrt(sq / K + eps)[:, None]  # [BM, 1]
        acc = acc * rstd
        up = up * rstd
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    out_ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        res = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=out_ok, other=0.0)
        acc += res.to(tl.float32)
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
    weight: Tensor,  # [N, K], or [2N, K] gate rows then up rows when gated (contiguous)
    norm_weight: Tensor | None = None,  # [K]: RMS-normalise the rows first
    eps: float = 1e-6,
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
        x, weight, norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out, out,
        M, N, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), eps,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, GATED=gated,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def fused_linear_torch(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K] or [2N, K] when gated
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    residual: Tensor | None = None,  # [M, N]
    gated: bool = False,
) -> Tensor:  # [M, N] in x's dtype
    """``fused_linear``'s computation in float32 PyTorch, rounded once at the end."""
    h = x.float()
    if norm_weight is not None:
        h = F.rms_norm(h, (h.shape[-1],), eps=eps) * norm_weight.float()
    y = h @ weight.float().t()  # [M, N or 2N]
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
