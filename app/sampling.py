"""Request fields -> ``SamplingParams``, checked against the model's context length."""

from __future__ import annotations

from collections.abc import Iterable

from app.errors import bad_request
from app.schemas import SamplingFields
from engine.params import SamplingParams


def resolve_max_tokens(requested: int | None, default: int, context_used: int, max_len: int) -> int:
    """Explicit ``max_tokens`` must fit; a default is clipped to the room left."""
    room = max_len - context_used
    if room < 1:
        raise bad_request(
            f"the prompt is {context_used} tokens; the model's context is {max_len} tokens",
            "prompt",
            "context_length_exceeded",
        )
    if requested is None:
        return min(default, room)
    if requested > room:
        raise bad_request(
            f"max_tokens is {requested} but only {room} tokens fit after the prompt "
            f"({context_used} tokens; context {max_len})",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def build_sampling(
    req: SamplingFields, max_tokens: int, stop_token_ids: Iterable[int] = ()
) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            stop_token_ids=(*stop_token_ids, *(req.stop_token_ids or ())),
            ignore_eos=bool(req.ignore_eos),
            logprobs=req.logprob_count,
            prompt_logprobs=req.prompt_logprob_count,
            logit_bias=tuple((int(t), v) for t, v in (req.logit_bias or {}).items()),
            min_tokens=req.min_tokens or 0,
        )
    except ValueError as exc:  # messages name the field and quote only numbers
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field if field.isidentifier() else None) from None
