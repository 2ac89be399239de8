"""LLMEngine._sample_rows: one token per row, whole batches without row selection, mixed
batches by selection, penalties row by row."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams, SpecConfig

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
        assert eng._sample_rows(seqs, logits) == peaks, params
        for s in seqs:
            eng.abort_request(s.request_id)
