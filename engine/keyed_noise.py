"""Position-keyed noise: the randomness of a seeded sampled request.

A sampled token is the first arrival of an exponential race over its law (``engine.sampling``):
token ``v`` arrives at ``E_v / p_v`` with ``E_v ~ Exp(1)``. An unseeded request draws the
``E_v`` from a generator. A seeded one takes them from a hash of ``(seed, t, v)``, ``t`` being
the position of the drawn token in the sequence (its index in the sequence's token list): the
noise of a position is fixed before anything is drawn. So the token a seed gives at a position
depends on the law there alone, not on how many draws came before it. Two consequences:

* a seeded request gives the same tokens alone or in any batch, under any speculation method
  and any load (no draws of a stream are consumed by coins or sampled drafts);
* a speculative step verifies a seeded request as it verifies a greedy one: a drafted token is
  accepted iff it is the token the race at its parent gives (``keyed_tokens``), and the
  tokens emitted are exactly those of autoregressive decoding with that seed, whatever was
  drafted. Each is the race's first arrival over noise independent of everything before it, so
  it has exactly the target law. Drafting may race the draft model's law over the same noise
  (``keyed_exponentials``), which proposes the target's token whenever the two laws agree
  (Gumbel-max coupling).

The hash is integer arithmetic on int64 tensors, exact on every device: 32-bit words mixed by
a finaliser of Wellons' whose multipliers keep every product inside int64's range; the top 24
bits of each entry give its uniform, exact in float32 (a law off by about 2**-24 at most in any
token's probability).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from engine.host_tensor import to_device

_MASK32 = 0xFFFFFFFF
# Odd constants xored into each word before it is mixed, one per role, so that equal words in
# different roles (a seed's half and a position, say) mix to different keys.
_SEED_LOW, _SEED_HIGH, _POSITION, _TOKEN = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche mix of int64 ``x`` in [0, 2**32): Wellons' ``lowbias32_r`` (shifts
    16, 15, 15), whose multipliers are below 2**31, so no product leaves int64's range."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _row_keys(seeds: list[int], positions: list[int], device: torch.device | str) -> Tensor:
    """One 32-bit key per row [R] int64 from its seed (any non-negative int; its low 64 bits
    count) and position."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    if any(p < 0 for p in positions):
        raise ValueError(f"positions must be non-negative, got {positions}")
    words = to_device(torch.tensor(
        [[s & _MASK32, (s >> 32) & _MASK32, p & _MASK32] for s, p in zip(seeds, positions, strict=True)],
        dtype=torch.int64,
    ).reshape(len(seeds), 3), device)  # [R, 3]
    key = _mix32(words[:, 0] ^ _SEED_LOW)
    key = _mix32(key ^ _mix32(words[:, 1] ^ _SEED_HIGH))
    return _mix32(key ^ _mix32(words[:, 2] ^ _POSITION))  # [R]


def keyed_exponentials(
    seeds: list[int], positions: list[int], vocab_size: int, device: torch.device | str = "cpu"
) -> Tensor:
    """The race's noise [R, V] float32 (i.i.d. Exp(1) in law) of row r: ``E(seeds[r],
    positions[r], v)`` for every vocabulary id ``v``; the same on every device and in any
    batch."""
    key = _row_keys(seeds, positions, device)[:, None]  # [R, 1]
    bits = _mix32(key ^ _token_words(vocab_size, torch.device(device))[None, :])  # [R, V]
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # [R, V] in (0, 1), 24 bits: exact in float32
    return -torch.log(uniform)  # [R, V]


@functools.cache
def _token_words(vocab_size: int, device: torch.device) -> Tensor:
    """Each vocabulary id's own mixed word [V] int64 (computed once per vocabulary and device)."""
    return _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _TOKEN)


def keyed_race(probs: Tensor, seeds: list[int], positions: list[int]) -> tuple[Tensor, Tensor]:
    """The token each row of ``probs`` [R, V] (non-negative, not necessarily normalised) gives
    at its position under its seed [R], and whether the row had probability mass [R] bool."""
    if probs.dim() != 2 or probs.shape[0] != len(seeds):
        raise ValueError(f"probs must be [R, V] with one seed per row, got {tuple(probs.shape)}")
    noise = keyed_exponentials(seeds, positions, probs.shape[1], probs.device)  # [R, V]
    tiny = torch.finfo(torch.float32).tiny
    best, tokens = (probs.float() / noise.clamp_(min=tiny)).max(dim=-1)  # [R] x2
    return tokens, best > 0


def keyed_tokens(probs: Tensor, seed: int, positions: list[int]) -> list[int]:
    """One seeded request's tokens, read to the host: row ``i`` of ``probs`` [N, V] drawn at
    ``positions[i]`` (its decode step's row, or each node of its tree). A row without
    probability mass is an error."""
    tokens, ok = keyed_race(probs, [seed] * len(positions), positions)
    if not bool(ok.all()):
        raise ValueError("probs has no positive mass")
    return [int(t) for t in tokens.tolist()]
