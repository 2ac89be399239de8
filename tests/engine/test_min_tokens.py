"""``SamplingParams.min_tokens`` (vLLM's): no EOS or stop token ends the output before it has
that many tokens, whichever method decodes, the speculative verify banning them at the tree
nodes whose token would come too early."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams, SpecConfig

PROMPTS = [[1, 2, 3, 4], [5, 0, 2], [3, 3, 1, 0, 4, 2]]


@pytest.mark.parametrize("method", ["none", "chain", "tree", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_end_the_bias_forces_comes_right_after_min_tokens(
    small_vocab_dir: Path, method: str, temperature: float
) -> None:
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method))  # type: ignore[arg-type]
    (eos,) = eng.eos_token_ids
    stop = next(t for t in range(6) if t != eos)
    for ends in ({eos: 100.0}, {stop: 100.0}):
        forced = dict(max_tokens=20, temperature=temperature, logit_bias=ends, stop_token_ids=(stop,))
        assert all(o.token_ids == [*ends] for o in eng.generate(PROMPTS, SamplingParams(**forced)))  # type: ignore[arg-type]
        for o in eng.generate(PROMPTS, SamplingParams(**forced, min_tokens=6)):  # type: ignore[arg-type]
            assert len(o.token_ids) == 7 and o.finish_reason == "stop", o.token_ids
            assert not {eos, stop} & set(o.token_ids[:6]) and o.token_ids[6] in ends


def test_min_tokens_is_checked(small_vocab_dir: Path) -> None:
    for bad in (-1, 17, 2.0):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(max_tokens=16, min_tokens=bad)  # type: ignore[arg-type]
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"))
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
