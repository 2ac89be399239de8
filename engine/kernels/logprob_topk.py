"""Fused Triton kernel: log-softmax and top-k of each row of logits, in one launch.

Drafting a tree depth scores the frontier's logits: ``log_softmax`` then a vocabulary-wide
``topk``, which in PyTorch is four to six kernels (a sort-based top-k among them) costing tens of
microseconds per depth at batch 1. Here program ``r`` loads row ``r`` whole (the vocabulary
fits in registers up to ``MAX_VOCAB``), computes its log-sum-exp, then takes the maximum ``k``
times, masking each pick: values descending, ties to the lower token id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_VOCAB = 32768  # larger vocabularies take the PyTorch path


@triton.jit
def _logprob_topk_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, stride_out, K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    lse = top + tl.log(tl.sum(tl.exp(x - top), axis=0))
    for j in tl.static_range(K):
        best = tl.max(x, axis=0)
        pick = tl.min(tl.where(x == best, offs, BLOCK), axis=0)  # the lowest id among ties
        tl.store(val_ptr + r * stride_out + j, best - lse)
        tl.store(idx_ptr + r * stride_out + j, pick.to(tl.int64))
        x = tl.where(offs == pick, float("-inf"), x)


def logprob_topk_triton(
    logits: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """``log_softmax(logits, -1).topk(k)`` over the last dim: (values float32, indices int64).
    ``out``: where to write them for 2-D ``logits`` [R, V] (values, indices [R, k] views with
    contiguous columns and one row stride, e.g. columns of a larger buffer)."""
    *lead, V = logits.shape
    rows = logits.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    if out is None:
        values = torch.empty(R, k, dtype=torch.float32, device=logits.device)
        index = torch.empty(R, k, dtype=torch.int64, device=logits.device)
    else:
        values, index = out
        assert logits.dim() == 2 and values.shape == index.shape == (R, k)
        assert values.dtype == torch.float32 and index.dtype == torch.int64
        assert values.stride() == index.stride() and values.stride(1) == 1
    block = triton.next_power_of_2(V)
    _logprob_topk_kernel[(R,)](rows, values, index, V, rows.stride(0), values.stride(0), K=k, BLOCK=block,
                               num_warps=8 if block >= 4096 else 4)  # fmt: skip
    return (values, index) if out is not None else (values.view(*lead, k), index.view(*lead, k))
