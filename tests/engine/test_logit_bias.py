"""OpenAI's ``logit_bias`` (``SamplingParams.logit_bias``): added to the target's logits before
every draw, so speculation verifies against the biased law and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams, SpecConfig

PROMPTS = [[1, 2, 3, 4], [5, 0, 2], [3, 3, 1, 0, 4, 2]]
METHODS = ["none", "chain", "tree", "adaptive"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_a_bias_is_the_biased_argmax_whatever_the_method(
    small_vocab_dir: Path, method: str
) -> None:
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method))  # type: ignore[arg-type]
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    unbiased = [o.token_ids for o in base.generate(PROMPTS, plain)]
    favoured = max(range(6), key=lambda t: sum(ids.count(t) for ids in unbiased))  # the commonest
    biased = SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, logit_bias={favoured: -1.5, 5: 1.0}
    )
    want = [o.token_ids for o in base.generate(PROMPTS, biased)]
    assert want != unbiased, "the bias changed nothing: a weak test"
    got = eng.generate(PROMPTS, biased)
    assert [o.token_ids for o in got] == want
    if method in ("chain", "tree"):
        assert any(o.stats.num_accepted_tokens for o in got)
    forced = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={4: 100})
    assert all(set(o.token_ids) == {4} for o in eng.generate(PROMPTS, forced))


@pytest.mark.parametrize("method", METHODS)
def test_sampling_keeps_to_the_tokens_the_bias_allows(small_vocab_dir: Path, method: str) -> None:
    """A bias of -100 on all but two tokens leaves the law on those two: drafts of the others,
    which the unbiased target would accept, are rejected."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method))  # type: ignore[arg-type]
    sp = SamplingParams(
        max_tokens=30, temperature=1.0, ignore_eos=True, logit_bias={t: -100 for t in (0, 1, 4, 5)}
    )
    outs = eng.generate(PROMPTS * 3, sp)
    seen = {t for o in outs for t in o.token_ids}
    assert seen == {2, 3}
    if method in ("chain", "tree"):
        assert sum(o.stats.num_steps for o in outs) < sum(
            len(o.token_ids) for o in outs
        )  # drafts accepted


def test_bad_logit_bias_is_a_value_error(small_vocab_dir: Path) -> None:
    for bad in ({1: 100.5}, {-1: 1.0}, {"x": 1.0}, [(1, 1.0), (1, 2.0)], {1: "high"}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={"3": 2}).logit_bias == ((3, 2.0),)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"))
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 6\)"):
        eng.add_request("r", [1, 2], SamplingParams(logit_bias={6: 1.0}))
