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

With ``FILTER`` (a row of a batch where some request uses top-k or top-p) the law is
``probs_from_logits``'s: the row's top ``k`` tokens of ``l / T`` (ties to the lower id), then
the smallest prefix of them, by that order and under their renormalised law, whose mass
before each kept token is below ``p``, then the softmax over what is kept. The torch ops sort
every row and scatter the mask back (a sort, a cumsum, a scatter and ~10 element-wise kernels
per depth). Here the row's keys ``l / T`` are sorted in registers (``tl.sort``), the kept
prefix is found on the sorted row (``tl.cumsum``: its length and its smallest key), and the
tokens above that key are kept with, of those equal to it, the lowest ids up to the prefix's
length: the reference's stable order, exactly. Masses are summed in another order than torch's
cumsum, so a token whose mass before it is within rounding of ``p`` may fall on the other side;
nothing else differs. Sorting the row in registers limits this variant to ``MAX_FILTER_VOCAB``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_VOCAB = 32768  # larger vocabularies take the PyTorch path
MAX_FILTER_VOCAB = 8192  # with top-k / top-p (the row is sorted in registers)
_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: keeps the keys finite


@triton.jit
def _filter_keep(x, offs, V, top_k, top_p):
    """Which tokens of ``x = l / T`` (-inf outside the vocabulary) the top-k then top-p rule
    keeps (``probs_from_logits``); ``top_k`` 0 or ``top_p`` 1: that rule is off."""
    k = tl.where((top_k <= 0) | (top_k > V), V, top_k)
    xs = tl.sort(x, descending=True)  # offs: ranks in the sorted row
    in_k = offs < k
    es = tl.where(in_k, tl.exp(xs - tl.max(xs, axis=0)), 0.0)
    ps = es / tl.sum(es, axis=0)  # the top-k law, sorted (tied tokens have equal masses)
    before = tl.cumsum(ps, axis=0) - ps  # mass before each token
    bound = tl.where(top_p >= 1.0, 2.0, top_p)  # 1.0: every token (the mass before is at most ~1)
    kept = in_k & ((before < bound) | (offs == 0))  # a prefix of the sorted row
    count = tl.sum(kept.to(tl.int32), axis=0)
    last = tl.min(tl.where(kept, xs, float("inf")), axis=0)  # the smallest kept value
    # Tokens above ``last`` are kept; of those equal to it, the lowest ids, up to ``count``.
    tied = x == last
    tie_rank = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)  # among the ties, by id
    above = tl.sum((x > last).to(tl.int32), axis=0)
    return (x > last) | (tied & (tie_rank < count - above))


# One compiled program per (FILTER, logits dtype, vocabulary), whatever the draws (their count,
# the outputs' row stride) and the group size: a new specialisation compiles while a request
# waits (the sorting one for seconds), so the engine compiles the few it uses at start-up
# (``engine.spec.device_tree.warm_race_draw``).
@triton.jit(do_not_specialize=["rows_per_temp", "stride_out", "K"])
def _race_draw_kernel(x_ptr, temp_ptr, topk_ptr, topp_ptr, noise_ptr, q_ptr, key_ptr, idx_ptr, V,
                      rows_per_temp, stride_x, stride_noise, stride_q, stride_out, K,
                      FILTER: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    t = tl.load(temp_ptr + r // rows_per_temp)
    x = tl.load(x_ptr + r * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32) / t
    if FILTER:
        top_k = tl.load(topk_ptr + r // rows_per_temp)
        top_p = tl.load(topp_ptr + r // rows_per_temp)
        x = tl.where(_filter_keep(x, offs, V, top_k, top_p), x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))  # 0 outside the vocabulary and the filters
    q = e / tl.sum(e, axis=0)
    tl.store(q_ptr + r * stride_q + offs, q, mask=inside)
    if K > 0:
        noise = tl.load(noise_ptr + r * stride_noise + offs, mask=inside, other=1.0)
        key = tl.where(inside, q / tl.maximum(noise, _TINY), -1.0)
        for j in range(K):
            best = tl.max(key, axis=0)
            pick = tl.min(tl.where(key == best, offs, BLOCK), axis=0)  # the lowest id among ties
            tl.store(key_ptr + r * stride_out + j, best)
            tl.store(idx_ptr + r * stride_out + j, pick.to(tl.int64))
            key = tl.where(offs == pick, -1.0, key)


def race_draw_triton(
    logits: Tensor, temperature: Tensor, rows_per_temp: int, noise: Tensor | None, k: int,
    top_k: Tensor | None = None, top_p: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """For logits [R, V]: the law ``softmax(logits / T)`` [R, V] float32, row ``r`` at
    temperature ``temperature[r // rows_per_temp]``, and the ``k`` largest race keys
    ``q / max(noise, tiny)`` of each row [R, k] float32 with their token ids [R, k] int64
    (``k = 0``: the law only; ``noise`` [R, V] float32 may then be None). With ``top_k`` and
    ``top_p`` (per group, like ``temperature``; 0 and 1.0: off) the law is filtered by them as
    ``probs_from_logits`` filters it (``V <= MAX_FILTER_VOCAB``)."""
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
    filtered = top_k is not None and top_p is not None
    if filtered:
        assert V <= MAX_FILTER_VOCAB, f"top-k / top-p rows need V <= {MAX_FILTER_VOCAB}, got {V}"
        if top_k.dtype != torch.int32:  # type: ignore[union-attr]
            top_k = top_k.clamp(max=V).to(dtype=torch.int32)  # type: ignore[union-attr]  # k >= V: every token
        top_p = top_p.to(dtype=torch.float32)  # type: ignore[union-attr]
    else:
        top_k = top_p = temperature  # not read
    block = triton.next_power_of_2(V)
    _race_draw_kernel[(R,)](logits, temperature, top_k, top_p, noise, q, keys, index, V, rows_per_temp,
                            logits.stride(0), noise.stride(0), q.stride(0), keys.stride(0), k,
                            FILTER=filtered, BLOCK=block, num_warps=8 if block >= 4096 else 4)  # fmt: skip
    return q, keys[:, :k], index[:, :k]
