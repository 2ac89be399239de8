"""engine.token_draw.sample_tokens: one token per row, whole batches without row selection, mixed
batches by selection, penalties row by row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.token_draw import draw_sampled, sample_tokens

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=4, temperature=0.7)
PENALISED = SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=1.0)


def _seqs(eng: LLMEngine, params: list[SamplingParams]) -> list:  # type: ignore[type-arg]
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", [1, 2, 3], p)
    return list(eng.scheduler.waiting)  # queued, never stepped: sampled rows come from logits below


def test_each_row_gets_its_own_rule(dense_model_dir: Path) -> None:
    eng = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="none"))
    vocab = eng.model_config.vocab_size
    peaks = [5, 9, 2, 7]
    logits = torch.full((4, vocab), -30.0)
    logits[torch.arange(4), torch.tensor(peaks)] = 30.0  # each row's mass on one token
    for params in ([GREEDY] * 4, [SAMPLED] * 4, [GREEDY, SAMPLED, PENALISED, SAMPLED]):
        seqs = _seqs(eng, params)
        assert sample_tokens(seqs, logits, vocab) == peaks, params
        for s in seqs:
            eng.abort_request(s.request_id)


def test_plain_temperature_rows_race_the_noise_draw_rows_would_draw(
    dense_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unseeded rows take the fused draw (race_draw); seeded rows the law and draw_rows. Over
    # the same default-generator state, the fused draw picks the tokens draw_rows picks from
    # the same law.
    import engine.token_draw as token_draw
    from engine.sampling import draw_rows, temperature_softmax

    fused_calls: list[tuple[int, int]] = []  # (rows, draws) of each race_draw call
    race_draw = token_draw.race_draw
    monkeypatch.setattr(token_draw, "race_draw",
                        lambda x, t, per, k, *a: fused_calls.append((x.shape[0], k)) or race_draw(x, t, per, k, *a))
    eng = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="none"))
    vocab = eng.model_config.vocab_size
    temps = [0.5, 0.7, 1.0, 1.3, 2.0, 0.9]
    logits = torch.randn(len(temps), vocab, generator=torch.Generator().manual_seed(0)) * 2.0  # [S, V]
    seqs = _seqs(eng, [SamplingParams(max_tokens=4, temperature=t) for t in temps])
    for seed in range(20):
        torch.manual_seed(seed)
        fused, ok = draw_sampled(logits, seqs, [3] * len(seqs))
        torch.manual_seed(seed)
        want, want_ok = draw_rows(temperature_softmax(logits, torch.tensor(temps)), [None] * len(temps))
        assert fused.tolist() == want.tolist() and ok.all() and want_ok.all()
    assert fused_calls == [(len(temps), 1)] * 20
    for s in seqs:
        eng.abort_request(s.request_id)
    top_k = _seqs(eng, [SamplingParams(max_tokens=4, temperature=0.7, top_k=1)])
    assert draw_sampled(logits[:1], top_k, [3])[0].tolist() == [int(logits[0].argmax())]
    assert fused_calls[20:] == [(1, 1)]  # top-k and top-p rows too, from the filtered law
    for s in top_k:
        eng.abort_request(s.request_id)
    seeded = _seqs(eng, [SamplingParams(max_tokens=4, temperature=0.7, seed=3)])
    drawn = []
    for seed in (0, 1):  # whatever the default generator's state: the draw keyed by seed and position
        torch.manual_seed(seed)
        token, ok = draw_sampled(logits[:1], seeded, [3])
        assert ok.tolist() == [True]
        drawn.append(token.tolist())
    assert drawn[0] == drawn[1]
    assert fused_calls[21:] == [(1, 0), (1, 0)]  # the law alone; draw_rows draws the token
    law = temperature_softmax(logits[:1], torch.tensor([0.7]))
    assert drawn[0] == draw_rows(law, [(3, 3)])[0].tolist()


def test_a_sampled_row_with_no_mass_is_flagged(dense_model_dir: Path) -> None:
    eng = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="none"))
    vocab = eng.model_config.vocab_size
    logits = torch.zeros(2, vocab)
    logits[1] = float("nan")  # a broken row: no law to draw from
    _, ok = draw_sampled(logits, _seqs(eng, [SAMPLED, SAMPLED]), [3, 3])
    assert ok.tolist() == [True, False]


def test_a_top_k_past_the_vocabulary_keeps_every_token(small_vocab_dir: Path) -> None:
    # The API allows any top_k up to 2**31 - 1 and the engine any integer: the device step's
    # int32 buffers take it clamped to the vocabulary (an unclamped 2**40 had overflowed them).
    huge = SamplingParams(max_tokens=6, temperature=0.8, top_k=2**40, ignore_eos=True)
    for spec in (SpecConfig(method="none"), SpecConfig(method="tree", topk=2, depth=2, num_draft_tokens=3)):
        eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=EngineConfig(cuda_graphs=True))
        assert len(eng.generate([[1, 2, 3]] * 3, huge)[0].token_ids) == 6


def test_a_temperature_too_small_to_divide_by_decodes_greedily(small_vocab_dir: Path) -> None:
    # Logits divided by 1e-40 overflow float32: no law was left to draw from, the engine step
    # raised, and the server failed every request of that step. Below MIN_TEMPERATURE a
    # request decodes greedily, the law's limit; at it, it still samples.
    from engine.params import MIN_TEMPERATURE

    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True)
    for spec in (SpecConfig(method="none"), SpecConfig(method="tree", topk=2, depth=2, num_draft_tokens=3)):
        eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=EngineConfig(cuda_graphs=True))
        want = [o.token_ids for o in eng.generate([[1, 2, 3], [4, 5]], greedy)]
        assert [o.token_ids for o in eng.generate([[1, 2, 3], [4, 5]], tiny)] == want
