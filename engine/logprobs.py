"""Log-probabilities of generated tokens (``SamplingParams.logprobs``).

As vLLM's default (raw log-probabilities): the model's own distribution, the log-softmax of the
target's logits in float32, before temperature, top-k / top-p and penalties, whatever rule drew
the token. Each token carries its own log-probability and the ``k`` most likely tokens of that
position with theirs. Speculative steps read them off the verify forward's rows of the accepted
path (the row of each accepted node predicts the next token), autoregressive steps and the
prefill off their logits: the same rows of the same model, so every method gives the same
values (to float32 rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.host_tensor import int_tensor, to_device

MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit; vLLM's default cap)


class TokenLogprob(NamedTuple):
    """One generated token's log-probability and the ``k`` most likely tokens of its position
    (``top``: (token id, log-probability), most likely first; empty for k = 0)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under row ``i`` of ``logits`` [R, V], and the ``k`` most
    likely tokens of each row (one device-to-host copy)."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(tokens)} tokens")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    index = to_device(int_tensor(tokens), logits.device).unsqueeze(1)  # [R, 1]
    chosen = logp.gather(1, index).squeeze(1).tolist()
    if k:
        top_values, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [R, k]
        tops = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops, strict=True)]
