"""Log-probabilities of generated tokens (``SamplingParams.logprobs``, ``engine/logprobs.py``):
transformers' DeepSeek-V3 over the prompt and the generated tokens is the reference, whatever
method generated them (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.logprobs import MAX_LOGPROBS, token_logprobs
from tests.model_factory import build_checkpoint

PROMPTS = [[3, 1, 2, 5, 0, 2, 7], [4, 5, 6], [1, 2, 3, 4, 5, 6]]
METHODS = ["none", "chain", "tree", "adaptive"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A vocabulary of 8: random MTP modules' drafts are accepted often enough.
    return build_checkpoint(tmp_path_factory.mktemp("logprobs"), seed=5, vocab_size=8, num_nextn_predict_layers=2)


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V]: the log-softmax of the position before each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_models_whatever_the_method(
    folder: Path, reference: torch.nn.Module, method: str, temperature: float
) -> None:
    """Each generated token's log-probability and its position's top 4, against transformers
    over the same tokens: the raw distribution (before temperature), prefill's first token,
    autoregressive and speculative steps alike."""
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method=method))
    sp = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True, logprobs=4)
    outs = eng.generate(PROMPTS, sp)
    if method in ("tree", "chain"):
        assert any(o.stats.num_accepted_tokens for o in outs), "no speculative step accepted a draft"
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
        want = _reference_logprobs(reference, prompt, out.token_ids)  # [12, V]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], rtol=0, atol=1e-4)
        for lp, row in zip(out.logprobs, want, strict=True):
            values, ids = row.topk(4)
            assert [t for t, _ in lp.top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, rtol=0, atol=1e-4)


def test_logprobs_follow_the_output_to_its_stop(folder: Path) -> None:
    """A stop met inside an accepted path ends the log-probabilities with the tokens; steps
    deliver them with their tokens; no top alternatives for logprobs=0; none unless asked."""
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="tree"))
    base = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop = base.token_ids[6]
    assert base.logprobs is None
    sp = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop,), logprobs=0)
    eng.add_request("r", PROMPTS[0], sp)
    streamed: list[int] = []
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.new_logprobs is not None and [lp.token_id for lp in o.new_logprobs] == o.new_token_ids
            streamed += o.new_token_ids
            final = o
    assert final is not None and final.finish_reason == "stop" and final.token_ids[-1] == stop
    assert final.logprobs is not None
    assert [lp.token_id for lp in final.logprobs] == final.token_ids == streamed
    assert all(lp.top == () for lp in final.logprobs)


def test_a_session_turn_has_its_own_logprobs(folder: Path) -> None:
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="tree"))
    eng.open_session("s")
    for turn in range(2):
        eng.add_request(f"t{turn}", PROMPTS[turn], SamplingParams(max_tokens=5, temperature=0.0, logprobs=1),
                        session_id="s")  # fmt: skip
        done = None
        while eng.has_unfinished_requests():
            done = next((o for o in eng.step() if o.finished), done)
        assert done is not None and done.logprobs is not None
        assert [lp.token_id for lp in done.logprobs] == done.token_ids


def test_bad_logprobs_are_value_errors() -> None:
    for bad in (-1, MAX_LOGPROBS + 1, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(torch.zeros(2, 5), [1], 0)


@pytest.mark.parametrize("chunk", [None, 3])
def test_prompt_logprobs_are_the_models(folder: Path, reference: torch.nn.Module, chunk: int | None) -> None:
    """Each prompt token but the first (no context) gets its log-probability and top 2 from
    the prefill, chunked or not, with the first output; a session turn scores its own prompt."""
    from engine import EngineConfig

    config = EngineConfig(prefill_chunk_tokens=chunk) if chunk else None
    eng = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="tree"), engine_config=config)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, eng.generate(PROMPTS, sp), strict=True):
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) and scored[0] is None
        with torch.no_grad():
            want = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        for i, lp in enumerate(scored[1:], start=1):
            assert lp is not None and lp.token_id == prompt[i]
            assert lp.logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4)
            assert [t for t, _ in lp.top] == want[i - 1].topk(2).indices.tolist()
    eng.open_session("s")
    for turn, prompt in enumerate(PROMPTS[:2]):
        eng.add_request(f"t{turn}", prompt, sp, session_id="s")
        first = None
        while first is None:  # the prompt may take several chunks
            first = next((o for o in eng.step() if o.request_id == f"t{turn}"), None)
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
        assert [lp.token_id for lp in first.prompt_logprobs[1:]] == prompt[1:]  # type: ignore[union-attr]
        while eng.has_unfinished_requests():
            eng.step()
