"""Fused Triton kernel: temperature softmax and an exponential race over each row of logits.

A sampled drafting depth turns the MTP head's logits into the draft law ``q = softmax(l / T)``
and draws its children from ``q`` without replacement by an exponential race (the top keys of
``q / E``, ``E`` exponential noise; ``engine.spec.graphed_sampled``). In PyTorch that is a
cast, a division, a softmax, a clamp, a division and a vocabulary-wide ``topk``; the radix
``topk`` alone is ~16 kernels even for one draw. On the H200 a sampled chain-6 step at batch
128 ran 509 kernels against 309 for the greedy one, 2.40 against 1.66 ms of device time
(``bench/results/h200-2026-12-04-session38-a5de5b9-spec-step-profile.txt``).

Here program ``r`` loads row ``r`` whole (the vocabulary fits in registers up to
``MAX_VOCAB``), writes its law ``q`` (float32) and takes the largest key ``K`` times, masking
each pick: keys descending, ties to the lower token id. ``K = 0`` writes ``q`` only (the target
law the verify step needs at every tree node). The noise comes from the caller (``exponential_``
on the device's generator: graph-safe, one kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_VOCAB = 32768  # larger vocabularies take the PyTorch path
_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: keeps the keys finite


@triton.jit
def _race_draw_kernel(x_ptr, temp_ptr, noise_ptr, q_ptr, key_ptr, idx_ptr, V, rows_per_temp,
                      stride_x, stride_noise, stride_q, stride_out,
                      K: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    t = tl.load(temp_ptr + r // rows_per_temp)
    x = tl.load(x_ptr + r * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32) / t
    e = tl.exp(x - tl.max(x, axis=0))  # 0 outside the vocabulary
    q = e / tl.sum(e, axis=0)
    tl.store(q_ptr + r * stride_q + offs, q, mask=inside)
    if K > 0:
        noise = tl.load(noise_ptr + r * stride_noise + offs, mask=inside, other=1.0)
        key = tl.where(inside, q / tl.maximum(noise, _TINY), -1.0)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            pick = tl.min(tl.where(key == best, offs, BLOCK), axis=0)  # the lowest id among ties
            tl.store(key_ptr + r * stride_out + j, best)
            tl.store(idx_ptr + r * stride_out + j, pick.to(tl.int64))
            key = tl.where(offs == pick, -1.0, key)


def race_draw_triton(
    logits: Tensor, temperature: Tensor, rows_per_temp: int, noise: Tensor | None, k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """For logits [R, V]: the law ``softmax(logits / T)`` [R, V] float32, row ``r`` at
    temperature ``temperature[r // rows_per_temp]``, and the ``k`` largest race keys
    ``q / max(noise, tiny)`` of each row [R, k] float32 with their token ids [R, k] int64
    (``k = 0``: the law only; ``noise`` [R, V] float32 may then be None)."""
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    q = torch.empty(R, V, dtype=torch.float32, device=dev)
    keys = torch.empty(R, max(k, 1), dtype=torch.float32, device=dev)
    index = torch.empty(R, max(k, 1), dtype=torch.int64, device=dev)
    if noise is None:
        assert k == 0, "drawing needs noise"
        noise = q  # not read
    assert noise.shape == (R, V) and noise.stride(-1) == 1 and noise.dtype == torch.float32
    temperature = temperature.to(dtype=torch.float32)
    block = triton.next_power_of_2(V)
    _race_draw_kernel[(R,)](logits, temperature, noise, q, keys, index, V, rows_per_temp,
                            logits.stride(0), noise.stride(0), q.stride(0), keys.stride(0),
                            K=k, BLOCK=block, num_warps=8 if block >= 4096 else 4)  # fmt: skip
    return q, keys[:, :k], index[:, :k]
