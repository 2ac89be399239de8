"""One token per sequence from a decode step's (or a prefill's last) logits, and its read.

Rows without penalties are drawn on the device in one batched call (``draw_tokens``): greedy
rows take the argmax, sampled rows race the noise ``engine.sampling.draw_rows`` would draw, in
one fused kernel on the GPU (``race_draw``); a seeded request's noise is keyed by its seed and
the token's position (``engine.keyed_noise``). The drawn tokens stay on the device until read,
packed with a per-row flag "the law had probability mass" so one copy brings both back
(``read_drawn``), or staged to pinned host memory so that work queued after them does not delay
their read (``stage_drawn`` / ``read_staged``). Rows with penalties, a logit bias or
``min_tokens`` are drawn one by one on the host path (``sample_one``: penalties count the generated tokens).
"""

from __future__ import annotations

import torch

from engine.host_tensor import int_tensor, to_device
from engine.keyed_noise import keyed_tokens
from engine.sampling import (
    SamplingTensors,
    apply_logit_bias,
    apply_penalties,
    ban_tokens,
    draw_rows,
    probs_from_logits,
    sample_from_probs,
    token_counts,
)
from engine.sequence import Sequence
from engine.spec.device_tree import race_draw


def sample_tokens(seqs: list[Sequence], logits: torch.Tensor, vocab_size: int) -> list[int]:
    """One token per row of ``logits`` [B, V], read to the host: rows without penalties drawn
    on the device in one read (``draw_tokens``), rows with penalties one by one."""
    plain = [i for i, s in enumerate(seqs) if not s.sampling.adjusts_logits]
    out: list[int | None] = [None] * len(seqs)
    if plain:
        everyone = len(plain) == len(seqs)
        tokens, ok = draw_tokens(seqs if everyone else [seqs[i] for i in plain],
                                 logits if everyone else logits[plain])  # fmt: skip
        for i, token in zip(plain, read_drawn(tokens, ok), strict=True):
            out[i] = token
    return [
        token if token is not None else sample_one(seqs[i], logits[i], vocab_size)
        for i, token in enumerate(out)
    ]


def draw_tokens(
    seqs: list[Sequence], logits: torch.Tensor, lands_at: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens [B] of ``seqs`` (none with penalties) left on the device: greedy rows the argmax,
    sampled rows one batched draw (seeded requests keyed by their seeds and the positions the
    tokens take, ``lands_at``, by default the end of each sequence's tokens; the others from
    the device's default generator, in one kernel); and whether each row had probability mass
    [B] bool (None: all greedy)."""
    sampled = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
    if not sampled:
        return logits.argmax(dim=-1), None
    everyone = len(sampled) == len(seqs)
    # The whole batch needs no row selection (an index copied to the device, a gather).
    index = None if everyone else to_device(int_tensor(sampled), logits.device)  # [S]
    rows = logits if index is None else logits.index_select(0, index)  # [S, V]
    at = None if lands_at is None else [lands_at[i] for i in sampled]
    drawn, ok = draw_sampled(rows, [seqs[i] for i in sampled], at)  # [S] x2
    if index is None:
        return drawn, ok
    every_ok = torch.ones(len(seqs), dtype=torch.bool, device=logits.device).index_copy(0, index, ok)
    return logits.argmax(dim=-1).index_copy(0, index, drawn), every_ok


def draw_sampled(
    rows: torch.Tensor, seqs: list[Sequence], lands_at: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``rows`` [S, V] (every sequence samples; its token takes position
    ``lands_at[i]``, by default the end of its tokens) [S] and whether its law had mass [S] bool. The law (top-k / top-p where a
    request uses them) and, from the device's default generator, the race over the noise
    ``draw_rows`` would draw, in one fused kernel on the GPU (``race_draw``); a batch with
    seeded rows takes the law alone and ``draw_rows`` with each seeded row's key."""
    params = [s.sampling for s in seqs]
    filters: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):  # known here: no device read
        st = SamplingTensors.from_params(params, rows.device)  # one copy
        temperature, filters = st.temperature, (st.top_k, st.top_p)
    else:  # one copy of the temperatures alone (a host-bound step's fewest kernels)
        temperature = to_device(torch.tensor([p.temperature for p in params]), rows.device)  # [S]
    if not any(p.keyed for p in params):
        _, keys, tokens = race_draw(rows, temperature, 1, 1, None, *filters)  # [S, 1] x2
        return tokens[:, 0], keys[:, 0] > 0
    law = race_draw(rows, temperature, 1, 0, None, *filters)[0]  # [S, V]
    at = [len(s.tokens) for s in seqs] if lands_at is None else lands_at
    return draw_rows(law, [(p.seed, t) if p.keyed and p.seed is not None else None
                          for p, t in zip(params, at, strict=True)])  # fmt: skip


def sample_one(seq: Sequence, logits: torch.Tensor, vocab_size: int) -> int:
    """``seq``'s token from its logits [V], penalties over its generated tokens, its logit
    bias and its ``min_tokens`` ban applied."""
    params = seq.sampling
    if params.has_penalties:
        counts = token_counts([seq.output_ids], vocab_size, logits.device)  # [1, V]
        logits = apply_penalties(
            logits[None],
            counts,
            torch.tensor([float(params.presence_penalty)]),
            torch.tensor([float(params.frequency_penalty)]),
        )[0]
    if params.logit_bias:
        logits = apply_logit_bias(logits[None], params.logit_bias)[0]
    if seq.ends and seq.num_output_tokens < params.min_tokens:
        logits = ban_tokens(logits[None], [0], seq.ends)[0]
    if params.greedy:
        return int(logits.argmax())
    probs = probs_from_logits(
        logits[None],
        torch.tensor([float(params.temperature)]),
        torch.tensor([int(params.top_k)]),
        torch.tensor([float(params.top_p)]),
    )[0]  # [V]
    if params.keyed and params.seed is not None:
        return keyed_tokens(probs[None], params.seed, [len(seq.tokens)])[0]
    return sample_from_probs(probs, seq.generator)


def read_drawn(tokens: torch.Tensor, ok: torch.Tensor | None, rows: list[int] | None = None) -> list[int]:
    """Read tokens drawn on the device (``draw_tokens``) in one copy, those of ``rows`` only if
    given; a sampled row read without probability mass is an error."""
    return _checked(_packed(tokens, ok).tolist(), rows)


def stage_drawn(tokens: torch.Tensor, ok: torch.Tensor | None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the copy of tokens drawn on the device (``draw_tokens``) to the host, without
    waiting: work queued on the device after it does not delay their read (``read_staged``).
    Returns the host rows (``_packed``) and the copy's event (None on a CPU, where the copy is
    done)."""
    packed = _packed(tokens, ok)
    if not packed.is_cuda:
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def read_staged(host: torch.Tensor, copied: torch.cuda.Event | None) -> list[int]:
    """The tokens ``stage_drawn`` started copying, once copied (checked as ``read_drawn``)."""
    if copied is not None:
        copied.synchronize()
    return _checked(host.tolist())


def _packed(tokens: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """Tokens [B] and whether each row had probability mass [B] (None: all greedy) as one
    tensor [1 or 2, B], read in one copy."""
    return tokens[None] if ok is None else torch.stack([tokens, ok.long()])


def _checked(packed: list[list[int]], rows: list[int] | None = None) -> list[int]:
    """The tokens of a read ``_packed`` (those of ``rows`` only if given); a sampled row without
    probability mass is an error."""
    if rows is not None:
        packed = [[line[r] for r in rows] for line in packed]
    if len(packed) > 1 and not all(packed[1]):
        raise ValueError("probs has a row with no positive mass")
    return packed[0]
