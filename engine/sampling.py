"""Logits processing and token drawing, one row per tree node (or per sequence).

The pipeline for a row is fixed and shared by the autoregressive path and the verifier, so the
distribution a speculative step reproduces is exactly the one autoregressive decoding samples:

1. ``apply_penalties``: OpenAI presence / frequency penalties over the tokens *generated* so far
   on that row's path: ``logits - frequency * count - presence * (count > 0)``.
2. ``probs_from_logits``: temperature scaling, then top-k, then top-p (nucleus) on the
   renormalised top-k distribution, then softmax. Temperature 0 gives a one-hot at the argmax.
3. ``sample_from_probs`` / ``sample_without_replacement``: draws with an exponential race
   (equivalently Gumbel-max / Gumbel-top-k), all randomness from the sequence's own generator,
   or for a seeded request from noise keyed by its seed and the token's position
   (``engine.keyed_noise``).

Tie rules (deterministic, documented so that tests can rely on them): top-k keeps exactly ``k``
tokens and, among tokens tied at the boundary, the lower ids (stable sort); greedy rows take
``torch.argmax`` (lowest id among ties).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.host_tensor import to_device
from engine.keyed_noise import keyed_exponentials
from engine.params import SamplingParams

_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors, built once per step from ``SamplingParams``."""

    temperature: Tensor  # [N] float32, 0 = greedy
    top_k: Tensor  # [N] int64, 0 = off
    top_p: Tensor  # [N] float32, 1.0 = off
    presence: Tensor  # [N] float32
    frequency: Tensor  # [N] float32

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        """One row per entry of ``params`` (repeat a sequence's params for each of its nodes).
        The five columns travel to the device in one copy (each copy from pageable host memory
        waits for the device's queued work: a decode step's sampling had paid five)."""
        host = torch.tensor(
            [[float(p.temperature), float(p.top_k), float(p.top_p), float(p.presence_penalty),
              float(p.frequency_penalty)] for p in params],
            dtype=torch.float64,
        ).reshape(len(params), 5)  # [N, 5]: exact for every float32 value and any top_k
        cols = to_device(host, device).t()  # [5, N]
        return cls(
            temperature=cols[0].float(),
            top_k=cols[1].long(),
            top_p=cols[2].float(),
            presence=cols[3].float(),
            frequency=cols[4].float(),
        )


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one sequence: seeded with ``seed``, or from ``os.urandom`` when None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1  # 63 bits: valid for manual_seed
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> Tensor:
    """Occurrence counts ``[N, V]`` int32 of each row's generated tokens (for the penalties)."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.int32, device=device)  # [N, V]
    rows = [i for i, ids in enumerate(token_ids) for _ in ids]
    cols = [t for ids in token_ids for t in ids]
    if cols:
        r = torch.tensor(rows, dtype=torch.int64, device=device)  # [T]
        c = torch.tensor(cols, dtype=torch.int64, device=device)  # [T]
        counts.index_put_((r, c), torch.ones_like(r, dtype=torch.int32), accumulate=True)
    return counts


def apply_penalties(
    logits: Tensor,  # [N, V] float32
    counts: Tensor,  # [N, V] int, occurrences among the generated tokens on the row's path
    presence: Tensor,  # [N]
    frequency: Tensor,  # [N]
) -> Tensor:
    """OpenAI penalties: ``logits - frequency * count - presence * (count > 0)`` (new tensor)."""
    if logits.shape != counts.shape:
        raise ValueError(f"counts shape {tuple(counts.shape)} != logits {tuple(logits.shape)}")
    freq = frequency.to(device=logits.device, dtype=logits.dtype)[:, None]  # [N, 1]
    pres = presence.to(device=logits.device, dtype=logits.dtype)[:, None]  # [N, 1]
    return logits - freq * counts.to(logits.dtype) - pres * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:
    """OpenAI's ``logit_bias``: ``bias``'s values added to its token ids' logits in every row of
    ``logits`` [N, V] (new tensor)."""
    ids = torch.tensor([t for t, _ in bias], device=logits.device)
    values = torch.tensor([v for _, v in bias], device=logits.device, dtype=logits.dtype)
    out = logits.clone()
    out[:, ids] += values
    return out


def ban_tokens(logits: Tensor, rows: list[int], ids: tuple[int, ...]) -> Tensor:
    """``logits`` [N, V] with ``ids`` at -inf in ``rows`` (new tensor): ``min_tokens``'s ban of
    the tokens that would end the output."""
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device)[:, None], torch.tensor(ids, device=logits.device)[None, :]] = float("-inf")
    return out


def probs_from_logits(
    logits: Tensor,  # [N, V]
    temperature: Tensor,  # [N] float, 0 = greedy
    top_k: Tensor,  # [N] int, 0 = off
    top_p: Tensor,  # [N] float, 1.0 = off
    *,
    filters: bool | None = None,
) -> Tensor:  # [N, V] float32
    """Temperature, then top-k, then top-p, then softmax; greedy rows are one-hot at argmax.

    Top-p keeps the smallest prefix of the (top-k renormalised) distribution sorted by
    probability whose mass reaches ``top_p``: a token is kept iff the mass strictly before it is
    below ``top_p``, so the top token is always kept.

    ``filters`` None looks at the parameters (reads the device) to skip work that cannot change
    the result; True / False fix that choice without reading the device (CUDA-graph capture):
    False promises no row uses top-k / top-p and none is greedy, True runs every stage.
    """
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)  # [N]
    if filters is False:  # every row samples with neither rule: the greedy and filter stages are no-ops
        return temperature_softmax(logits, temperature)
    logits = logits.float()  # [N, V]
    n, v = logits.shape
    greedy = temperature <= 0.0  # [N] bool
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)  # [N]
    scaled = logits / temp[:, None]  # [N, V]

    k = top_k.to(device=device, dtype=torch.int64).clamp(min=0, max=v)  # [N]
    k = torch.where(k == 0, torch.full_like(k, v), k)  # [N], 0 = off = keep all
    top_p = top_p.to(device=device, dtype=torch.float32)  # [N]
    use_p = (top_p < 1.0) & ~greedy  # [N]
    if filters is None:
        filtering = bool(((k < v) & ~greedy).any()) or bool(use_p.any())
    else:
        filtering = filters
    if filtering:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [N, V] x2
        ranks = torch.arange(v, device=device)  # [V]
        keep_sorted = ranks[None, :] < k[:, None]  # [N, V]
        if filters or bool(use_p.any()):
            masked = sorted_logits.masked_fill(~keep_sorted, float("-inf"))  # [N, V]
            sorted_probs = masked.softmax(dim=-1)  # [N, V]
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V] exclusive cumsum
            in_nucleus = (mass_before < top_p[:, None]) | ~use_p[:, None]  # [N, V]
            in_nucleus[:, 0] = True
            keep_sorted &= in_nucleus
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)  # [N, V]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = scaled.softmax(dim=-1)  # [N, V]
    if filters or (filters is None and bool(greedy.any())):
        one_hot = torch.zeros_like(probs)  # [N, V]
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def temperature_softmax(logits: Tensor, temperature: Tensor) -> Tensor:  # [N, V] -> [N, V] float32
    """softmax(logits / T) per row (``temperature`` [N] on the device): what every stage of
    ``probs_from_logits`` leaves of a row that samples (T > 0) with neither top-k nor top-p, in
    the same operations."""
    return (logits.float() / temperature[:, None]).softmax(dim=-1)


def _race_keys(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Exponential race: token i "arrives" at E_i / p_i; we return p_i / E_i (larger = earlier).

    The first arrival is token i with probability p_i / sum(p); the order of arrivals is a
    sample without replacement (Gumbel-top-k in disguise). Zero-probability tokens get key 0 and
    are never drawn. Unnormalised ``probs`` are fine.
    """
    exp = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)  # [V]
    return probs.float() / exp.clamp_(min=_TINY)  # [V]; the clamp avoids 0 / 0


def sample_from_probs(probs: Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` ``[V]`` (non-negative, not necessarily normalised)."""
    if probs.dim() != 1:
        raise ValueError(f"probs must be 1-D [V], got shape {tuple(probs.shape)}")
    best, token = _race_keys(probs, generator).max(dim=0)  # [] x2
    if not best.item() > 0:
        raise ValueError("probs has no positive mass")
    return int(token)


def draw_rows(probs: Tensor, keys: Sequence[tuple[int, int] | None]) -> tuple[Tensor, Tensor]:
    """One token per row of ``probs`` ``[R, V]``, left on the device: the tokens [R] and whether
    each row had positive mass [R] bool (the caller checks it when it reads the tokens, in the
    same copy).

    The same exponential race as ``sample_from_probs``: row r's noise keyed by ``keys[r]`` =
    (seed, position of the drawn token) (``engine.keyed_noise``: a seeded request draws the
    same token there whatever came before, alone or in a batch), or where None (unseeded
    requests) drawn from the device's default generator, all rows in one race."""
    if probs.dim() != 2 or probs.shape[0] != len(keys):
        raise ValueError(f"probs must be [R, V] with one key per row, got {tuple(probs.shape)}")
    keyed = [r for r, key in enumerate(keys) if key is not None]
    seeds = [key[0] for key in keys if key is not None]
    positions = [key[1] for key in keys if key is not None]
    noise = keyed_exponentials(seeds, positions, probs.shape[1], probs.device) if keyed else None  # [K, V]
    if noise is not None and len(keyed) == len(keys):
        exp = noise  # [R, V]
    else:
        exp = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_()  # [R, V]
        if noise is not None:
            exp[to_device(torch.tensor(keyed), probs.device)] = noise
    best, tokens = (probs.float() / exp.clamp_(min=_TINY)).max(dim=-1)  # [R] x2
    return tokens, best > 0


def sample_without_replacement(probs: Tensor, k: int, generator: torch.Generator) -> list[int]:
    """Up to ``k`` distinct tokens in draw order (fewer if fewer tokens have positive mass).

    The i-th token is distributed as ``probs`` restricted to the tokens not drawn before it and
    renormalised, which is what the without-replacement verifier assumes.
    """
    if probs.dim() != 1:
        raise ValueError(f"probs must be 1-D [V], got shape {tuple(probs.shape)}")
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    keys = _race_keys(probs, generator)  # [V]
    k = min(k, keys.numel())
    if k == 0:
        return []
    values, tokens = keys.topk(k)  # [k] x2, descending keys = arrival order
    return [int(t) for t, val in zip(tokens.tolist(), values.tolist(), strict=True) if val > 0]
