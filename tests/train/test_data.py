"""Token streams and windows: framing, determinism, bounds, coverage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from train.data import WindowSampler, encode_texts, eval_windows
from train.tokenizer import train_tokenizer

TEXTS = ["x = 1\n", "def f():\n    return 2\n", "print('hi')\n"] * 20


def test_each_text_is_framed_by_bos_and_eos() -> None:
    tok = train_tokenizer(TEXTS, vocab_size=300)
    stream = encode_texts(tok, TEXTS[:3], files_per_batch=2)
    assert stream.dtype == np.uint16
    bos, eos = tok.bos_token_id, tok.eos_token_id
    docs = np.split(stream, np.where(stream == eos)[0] + 1)[:-1]
    assert len(docs) == 3
    for doc, text in zip(docs, TEXTS[:3], strict=True):
        assert doc[0] == bos and doc[-1] == eos
        assert tok.decode(doc[1:-1].tolist()) == text


def _sampler(n: int = 1000, seq: int = 16, batch: int = 4, seed: int = 0) -> WindowSampler:
    return WindowSampler(np.arange(n, dtype=np.uint16), seq, batch, seed, torch.device("cpu"))


def test_a_batch_is_a_pure_function_of_seed_and_step() -> None:
    a, b = _sampler(), _sampler()
    for step in (0, 5, 17, 100):
        assert torch.equal(a.batch(step), b.batch(step))
    assert not torch.equal(_sampler(seed=1).batch(0), a.batch(0))


def test_windows_are_contiguous_in_bounds_and_cover_an_epoch_once() -> None:
    s = _sampler(n=1000, seq=16, batch=4)
    starts = []
    steps_per_epoch = s.num_windows // s.batch_size
    for step in range(steps_per_epoch):
        x = s.batch(step)  # [B, T]
        assert x.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(x - x[:, :1], torch.arange(16).expand(4, 16))  # contiguous slices
        assert int(x.max()) < 1000
        starts += x[:, 0].tolist()
    assert len(set(starts)) == len(starts)  # no window twice within an epoch
    assert len({st % 16 for st in starts}) == 1  # one grid offset per epoch


def test_too_short_stream_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="too few"):
        _sampler(n=20, seq=16)


def test_eval_windows_are_fixed_and_fit_short_streams() -> None:
    w = eval_windows(np.arange(100, dtype=np.uint16), seq_len=16, max_windows=3)
    assert w.shape == (3, 16) and w[1, 0] == 16
    short = eval_windows(np.arange(10, dtype=np.uint16), seq_len=16, max_windows=3)
    assert short.shape == (1, 10)
    with pytest.raises(ValueError, match="held-out split is empty"):
        eval_windows(np.zeros(0, dtype=np.uint16), 16, 3)
