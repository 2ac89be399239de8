"""Seeded sampled requests under speculation: draws keyed by (seed, position).

A seeded request's token at a position is the race over its law there with noise keyed by its
seed and that position (``engine.keyed_noise``), so speculation verifies it as a greedy one
against those draws. Its tokens must then be exactly those of autoregressive decoding with the
same seed under every method, alone or in any batch, on the host-driven and the static paths;
its joint law must be the target's (chi-square against the exact law of a 4-token model, as
``test_sampling_exactness_engine`` does for unseeded requests); and drafts must be accepted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import engine.keyed_noise as keyed_noise
from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tests.engine.test_sampling_exactness_engine import (
    PROMPT,
    SAMPLES,
    TEMPERATURE,
    _exact_joint,
    _p_value,
)
from tests.model_factory import build_checkpoint

TREE = SpecConfig(method="tree", topk=2, depth=3, num_draft_tokens=5)
METHODS = [SpecConfig(method="none"), SpecConfig(method="chain", depth=3), TREE, SpecConfig(method="adaptive")]
PROMPTS = [[1, 2, 3, 4], [2, 5, 1], [3, 3, 0, 1, 2], [5, 4]]


@pytest.fixture(scope="module")
def vocab4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("v4"), seed=11, vocab_size=4,
                            num_nextn_predict_layers=2, eos_token_id=None, bos_token_id=None)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=TEMPERATURE, seed=seed, ignore_eos=True)


def _engine(folder: Path, spec: SpecConfig, graphs: bool = False, device: str = "cpu") -> LLMEngine:
    config = EngineConfig(max_batch_size=256, cuda_graphs=graphs, overlap_steps=graphs)
    return LLMEngine.from_pretrained(folder, device=device, dtype="float32", spec=spec, engine_config=config)


def test_seeded_tree_sampling_matches_exact_joint_and_no_speculation(vocab4_dir: Path) -> None:
    params = [_seeded(seed) for seed in range(SAMPLES)]
    outs = _engine(vocab4_dir, TREE).generate([PROMPT] * SAMPLES, params)
    assert sum(o.stats.num_accepted_tokens for o in outs) > SAMPLES // 4  # drafts were used
    assert _p_value(_exact_joint(vocab4_dir), Counter(tuple(o.token_ids) for o in outs)) > 1e-3
    plain = _engine(vocab4_dir, SpecConfig(method="none")).generate([PROMPT] * SAMPLES, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_chi_square_catches_noise_not_keyed_by_position(vocab4_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One noise for every position of a request: its tokens are no longer independent draws.
    row_keys = keyed_noise._row_keys
    monkeypatch.setattr(keyed_noise, "_row_keys", lambda seeds, positions, device: row_keys(seeds, [0] * len(seeds), device))
    outs = _engine(vocab4_dir, TREE).generate([PROMPT] * SAMPLES, [_seeded(seed) for seed in range(SAMPLES)])
    assert _p_value(_exact_joint(vocab4_dir), Counter(tuple(o.token_ids) for o in outs)) < 1e-6


@pytest.mark.parametrize(("device", "graphs"), [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=pytest.mark.gpu)],
                         ids=["host", "static", "cuda-graphs"])  # fmt: skip
@pytest.mark.parametrize("extra", [{}, {"top_k": 3, "top_p": 0.9}, {"presence_penalty": 0.8, "logit_bias": {2: 3.0}}],
                         ids=["plain", "top-k-top-p", "penalties-bias"])  # fmt: skip
def test_a_seed_gives_the_same_tokens_under_every_method_alone_or_in_a_batch(
    small_vocab_dir: Path, device: str, graphs: bool, extra: dict[str, object]
) -> None:
    def seeded(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=20, temperature=1.0, seed=40 + i, ignore_eos=True, **extra)  # type: ignore[arg-type]

    base = _engine(small_vocab_dir, METHODS[0], graphs, device)
    want = [o.token_ids for o in base.generate(PROMPTS, [seeded(i) for i in range(4)])]
    for spec in METHODS:
        eng = _engine(small_vocab_dir, spec, graphs, device)
        alone = [eng.generate([p], seeded(i))[0].token_ids for i, p in enumerate(PROMPTS)]
        assert alone == want, spec
        others = [SamplingParams(max_tokens=25, temperature=0.0 if j % 2 else 0.8, ignore_eos=True) for j in range(4)]
        mixed = eng.generate(PROMPTS + PROMPTS, [seeded(i) for i in range(4)] + others)
        assert [o.token_ids for o in mixed[:4]] == want, spec
        if spec.method in ("chain", "tree"):
            assert sum(o.stats.num_draft_tokens for o in mixed[:4]) > 0, spec  # they speculated


def test_a_seeded_session_turn_continues_its_positions(small_vocab_dir: Path) -> None:
    # A session's second turn draws at the positions after the first turn's tokens: the same
    # under speculation as without.
    outs = []
    for spec in (SpecConfig(method="none"), TREE):
        eng = _engine(small_vocab_dir, spec)
        eng.open_session("s")
        turns = []
        for turn, prompt in enumerate(PROMPTS[:2]):
            sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
            eng.add_request(f"t{turn}", prompt, sp, session_id="s")
            done = []
            while eng.has_unfinished_requests():
                done += [o.token_ids for o in eng.step() if o.finished]
            turns.append(done[0])
        outs.append(turns)
    assert outs[0] == outs[1]
