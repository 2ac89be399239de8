"""Random mixed batches of valid sampling parameters never make a step raise, and leave nothing.

The server fails every request of a step that raises (``engine.serving.engine_loop``), so one
request's parameters must never make a step raise: here each speculation method, host-driven and
with the static (CUDA-graph) code run eagerly, decodes random batches mixing greedy and sampled
rows, temperatures at the edges (1e-40, which overflowed the logits, below ``MIN_TEMPERATURE``, at it, 100), top-k and top-p from
off to a single token and past the vocabulary, penalties, seeds, stop tokens, lengths,
log-probabilities, logit biases and minimum lengths. Every
request must finish within its ``max_tokens``, and the KV blocks must all come back.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig

VOCAB = 6  # small_vocab_dir's


def _random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.choice([1, 2, 5, 17])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 1e-40, 1e-6, 1e-5, 0.3, 1.0, 2.0, 100.0]),
        top_p=rng.choice([1e-9, 0.3, 0.9, 1.0, 1.0]),
        top_k=rng.choice([0, 0, 1, 3, VOCAB, VOCAB + 1, 2**40]),
        presence_penalty=rng.choice([0.0, 0.0, -2.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 1.5]),
        seed=rng.choice([None, None, 0, 12345]),
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 2]))),
        ignore_eos=rng.choice([True, False]),
        logprobs=rng.choice([None, None, None, 0, 3]),
        prompt_logprobs=rng.choice([None, None, None, 2]),
        logit_bias=rng.choice([(), (), (), ((rng.randrange(VOCAB), rng.choice([-100.0, 3.0, 100.0])),)]),
        min_tokens=rng.choice([0, 0, 0, max_tokens // 2, max_tokens]),
    )


@pytest.mark.parametrize("method", ["none", "chain", "tree", "adaptive"])
@pytest.mark.parametrize("graphs", [False, True], ids=["host", "static"])
def test_random_mixed_batches_finish_and_free_their_blocks(small_vocab_dir: Path, method: str, graphs: bool) -> None:
    rng = random.Random(f"{method}-{graphs}")
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method=method),  # type: ignore[arg-type]
                                    engine_config=EngineConfig(cuda_graphs=graphs, max_batch_size=8))  # fmt: skip
    idle_blocks = eng.kv_blocks_used
    for batch in range(12):
        wanted = {}
        for i in range(rng.randint(1, 8)):
            params = _random_params(rng)
            rid = f"b{batch}-{i}"
            eng.add_request(rid, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))], params)
            wanted[rid] = params.max_tokens
        finished = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
        assert set(finished) == set(wanted)
        assert all(len(out.token_ids) <= wanted[rid] for rid, out in finished.items())
        for out in finished.values():
            if out.logprobs is not None:
                assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert eng.kv_blocks_used == idle_blocks


@pytest.mark.parametrize(
    ("device", "graphs"),
    [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=pytest.mark.gpu)],
    ids=["cpu-host", "cpu-static", "cuda-graphs"],
)
def test_one_batch_of_every_kind_of_request_under_adaptive_speculation(
    small_vocab_dir: Path, device: str, graphs: bool
) -> None:
    """Greedy, unseeded and seeded sampled requests and requests asking for log-probabilities
    in one adaptive batch (on a GPU: CUDA graphs, device steps, steps launched ahead): greedy
    ones give the autoregressive tokens, seeded ones the tokens they give alone, and the
    log-probabilities are the autoregressive engine's (float32)."""

    def engine(method: str) -> LLMEngine:
        return LLMEngine.from_pretrained(
            small_vocab_dir, device=device, dtype="float32", spec=SpecConfig(method=method),  # type: ignore[arg-type]
            engine_config=EngineConfig(cuda_graphs=graphs, max_batch_size=8, max_model_len=96),
        )  # fmt: skip

    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(8)]
    kinds = {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "greedy-logprobs": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
        "sampled": SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True),
        "seeded-logprobs": SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True, logprobs=1),
    }
    names = [list(kinds)[i % len(kinds)] for i in range(len(prompts))]
    base = engine("none")
    alone = {i: base.generate([p], kinds[n])[0] for i, (p, n) in enumerate(zip(prompts, names, strict=True))
             if n != "sampled"}  # fmt: skip
    eng = engine("adaptive")
    for _ in range(2):  # the second batch with the arms measured
        outs = eng.generate(prompts, [kinds[n] for n in names])
        for i, out in alone.items():
            assert outs[i].token_ids == out.token_ids, names[i]
            if out.logprobs is not None:
                got, want = outs[i].logprobs, out.logprobs
                assert got is not None and len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    assert [t for t, _ in g.top] == [t for t, _ in w.top]
                    assert [g.logprob, *(v for _, v in g.top)] == pytest.approx([w.logprob, *(v for _, v in w.top)], abs=1e-4)
    assert eng.adaptive is not None
    assert any(arm.speculates for arm, steps in eng.adaptive.steps_per_arm.items() if steps), "it never drafted"
