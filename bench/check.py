"""Correctness before speed: greedy tokens of every mode against autoregressive decoding.

The engine's speculative modes are lossless, so under greedy decoding they must emit exactly the
``ar`` tokens; a mode that does not is not timed. transformers' ``generate()`` is an independent
implementation: it is compared too and the result recorded, but agreement there can also fail on
floating-point near-ties (reductions in another order), so it does not block its timing.
"""

from __future__ import annotations

from typing import Any


def compare_tokens(reference: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Whether ``got`` equals ``reference``, and where it first differs."""
    first = None
    identical = 0
    for i, (ref, out) in enumerate(zip(reference, got, strict=True)):
        if ref == out:
            identical += 1
            continue
        if first is None:
            pos = next((j for j, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b),
                       min(len(ref), len(out)))
            first = {"prompt": i, "position": pos}
    return {"match": first is None, "sequences": len(reference), "identical_sequences": identical,
            "first_mismatch": first, "tokens": len(reference[0]) if reference else 0}


def describe(result: dict[str, Any]) -> str:
    if result["match"]:
        return f"identical ({result['sequences']} x {result['tokens']} tokens)"
    m = result["first_mismatch"]
    return (f"DIFFERS: {result['identical_sequences']}/{result['sequences']} sequences identical, "
            f"first difference at prompt {m['prompt']} token {m['position']}")
