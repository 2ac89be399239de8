"""Prefill chunks and decode steps padded to captured (bucket, tokens) shapes
(engine/cuda_graphs.py), run eagerly on CPU: the same hidden states, cache entries and tokens as
the eager forward, and nothing left in the scratch block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.batch_builder import SeqRows, causal_mask
from engine.sequence import Sequence

PROMPTS = [[t % 6 for t in range(1, 11)], [3, 1, 4, 1, 5, 0, 2, 4, 5, 3, 5, 2, 1], [5, 5], [2] * 37]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(folder: Path, static: bool, method: str = "none", chunk: int = 32) -> LLMEngine:
    config = EngineConfig(cuda_graphs=static, prefill_chunk_tokens=chunk)
    return LLMEngine.from_pretrained(folder, spec=SpecConfig(method=method), engine_config=config)  # type: ignore[arg-type]


def _prefill_all(eng: LLMEngine) -> list[Sequence]:
    """Add PROMPTS and step until every prompt is prefilled (and one token sampled)."""
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"r{i}", prompt, GREEDY)
    while eng.scheduler.num_waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    return sorted(eng.scheduler.running, key=lambda s: s.request_id)


def _cache_entries(eng: LLMEngine, seq: Sequence) -> torch.Tensor:
    """[layers, committed, latent] entries of ``seq``'s committed tokens in every main layer."""
    bs = eng.pool.block_size
    slots = torch.tensor([seq.block_ids[p // bs] * bs + p % bs for p in range(seq.num_committed)])
    main = eng.pool.kv_cache[: eng.model_config.num_hidden_layers]
    return main.reshape(main.shape[0], -1, main.shape[-1])[:, slots]


def test_padded_prefill_matches_the_eager_one(small_vocab_dir: Path) -> None:
    eager, static = _engine(small_vocab_dir, False), _engine(small_vocab_dir, True)
    assert static.static_forward is not None
    shapes: list[tuple[int, int]] = []
    original = static.static_forward.run_prefill
    static.static_forward.run_prefill = lambda rows, shape: shapes.append(shape) or original(rows, shape)  # type: ignore[method-assign]
    seqs_e, seqs_s = _prefill_all(eager), _prefill_all(static)
    # Chunks of 32 tokens over prompts of 10, 13, 2 and 37 tokens: four sequences in (4, 16),
    # then the rest of the last one on top of its first 7 entries (ctx > 0) in (1, 32).
    assert shapes == [(4, 16), (1, 32)]
    for a, b in zip(seqs_e, seqs_s, strict=True):
        assert a.num_committed == b.num_committed == len(a.tokens) - 1
        assert a.tokens == b.tokens  # the first sampled token too
        torch.testing.assert_close(_cache_entries(static, b), _cache_entries(eager, a))
    scratch = static.static_scratch_blocks
    assert torch.count_nonzero(static.pool.kv_cache[:, scratch]) == 0, "padding rows left entries"


@pytest.mark.parametrize("method", ["none", "tree"])
def test_padded_prefill_gives_the_same_tokens(small_vocab_dir: Path, method: str) -> None:
    base = _engine(small_vocab_dir, False, "none", chunk=512).generate(PROMPTS, GREEDY)
    eng = _engine(small_vocab_dir, True, method, chunk=512)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert eng.kv_blocks_used == len(eng.static_scratch_blocks)
    assert torch.count_nonzero(eng.pool.kv_cache) == 0, "every freed block and scratch zeroed"


def test_prefill_shape_choice(small_vocab_dir: Path) -> None:
    static = _engine(small_vocab_dir, True, chunk=32).static_forward
    assert static is not None
    assert max(b * t for b, t in static.prefill_shapes) == 64  # twice the chunk

    def rows(*lengths: int, ctx: int = 0) -> list[SeqRows]:
        return [SeqRows(list(range(8)), ctx, [1] * n, list(range(ctx, ctx + n)), causal_mask(n)) for n in lengths]

    assert static.prefill_shape(rows(10)) == (1, 16)
    assert static.prefill_shape(rows(17, 3)) == (2, 32)
    assert static.prefill_shape(rows(5, 5, 5)) == (4, 16)
    assert static.prefill_shape(rows(65)) is None  # longer than any captured shape
    limited = rows(4)
    limited[0].query_ctx_lens = [0] * 4
    assert static.prefill_shape(limited) is None  # per-query limits: MTP rows, not a prefill
    far = rows(4, ctx=static.max_blocks * static.pool.block_size - 8)
    assert static.prefill_shape(far) is None  # padded keys would walk past the table


def test_padded_rows_that_are_not_a_plain_prefill_are_written_as_given(small_vocab_dir: Path) -> None:
    """The padded load computes slots, positions and masks for the whole shape from each row's
    context and length; a row with other positions or another mask keeps its own."""
    from engine.batch_builder import build_batch

    eager, static = _engine(small_vocab_dir, False), _engine(small_vocab_dir, True)
    assert static.static_forward is not None
    odd_mask = causal_mask(5).clone()
    odd_mask[1, 3] = True  # a row that sees a later one
    rows = [
        SeqRows([1, 2], 0, [3, 1, 4, 1, 5], list(range(5)), causal_mask(5)),
        SeqRows([3, 4], 0, [2, 5, 1, 0, 2], [0, 2, 4, 6, 8], causal_mask(5)),  # other positions
        SeqRows([5, 6], 0, [1, 4, 1, 3, 0], list(range(5)), odd_mask),
        SeqRows([7, 8], 0, [5, 3], [0, 1], causal_mask(2)),
    ]
    shape = static.static_forward.prefill_shape(rows)
    assert shape is not None
    got = static.static_forward.run_prefill(rows, shape)  # [N, H]
    ids, batch = build_batch(rows, eager.pool.block_size, eager.device)
    want = eager.model.forward_target(ids, batch, eager.pool.kv_cache)  # [N, H]
    torch.testing.assert_close(got, want)


def test_direct_decode_loads_follow_a_batch_that_shrinks_and_grows(small_vocab_dir: Path) -> None:
    """Autoregressive steps write their inputs straight into the static buffers and pad only
    the rows that stopped being real: a batch of 4 in bucket 4 that shrinks to 3, 2 and 1 and
    grows again by a late request gives the eager engine's tokens, and no row left over from a
    larger batch writes into a freed block."""
    lengths = [12, 9, 7, 4]  # the last row finishes first: its row becomes padding

    def run(eng: LLMEngine) -> dict[str, list[int]]:
        outs: dict[str, list[int]] = {}
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
            eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        steps = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                outs[out.request_id] = out.token_ids
            free = list(eng.pool._free)  # a stale padding row would write into a freed block
            assert torch.count_nonzero(eng.pool.kv_cache[:, free]) == 0, f"step {steps}"
            steps += 1
            if steps == 8:  # three have finished or are finishing: one joins the survivor
                eng.add_request("late", PROMPTS[2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        return outs

    eager, static = _engine(small_vocab_dir, False), _engine(small_vocab_dir, True)
    forward = static.static_forward
    assert forward is not None
    sizes: list[int] = []
    original = forward.run_decode
    forward.run_decode = lambda tokens, *a: sizes.append(len(tokens)) or original(tokens, *a)  # type: ignore[method-assign]
    assert run(static) == run(eager)
    assert 4 in sizes and 3 in sizes and 1 in sizes and sizes.index(1) < len(sizes) - 1, sizes
    assert sizes[-1] <= sizes[sizes.index(1) + 1], "the late request joined a smaller batch"
    assert torch.count_nonzero(static.pool.kv_cache) == 0, "every freed block and scratch zeroed"


def test_direct_decode_loads_rewrite_only_the_table_rows_that_changed(
    small_vocab_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_decode`` builds and copies only the block-table rows whose sequence or width
    changed since the last decode load. After every load each real row must still be its
    sequence's blocks up to the new token, then -1s, while rows move as requests finish out of
    order, a late request joins, and contexts cross block boundaries (4-token blocks)."""
    import engine.cuda_graphs as cuda_graphs

    config = EngineConfig(cuda_graphs=True, prefill_chunk_tokens=64, block_size=4)
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"), engine_config=config)
    forward = eng.static_forward
    assert forward is not None
    checked: list[tuple[int, int]] = []  # (batch, table rows built)
    built: list[int] = []
    int_table = cuda_graphs.int_table
    monkeypatch.setattr(cuda_graphs, "int_table", lambda rows, *a: built.append(len(rows)) or int_table(rows, *a))
    original = forward.run_decode

    def checking(tokens: list[int], blocks: list[list[int]], widths: list[int], contexts: list[int]) -> torch.Tensor:
        built.clear()
        hidden = original(tokens, blocks, widths, contexts)
        st = forward._static[(forward._bucket(len(tokens)), 1)]
        for i, (table, w) in enumerate(zip(blocks, widths, strict=True)):
            want = table[:w] + [-1] * (st.tables.shape[1] - w)
            assert st.tables[i].tolist() == want, (i, w)
        checked.append((len(tokens), sum(built)))
        return hidden

    forward.run_decode = checking  # type: ignore[method-assign]
    lengths = [14, 6, 11, 3]
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 5:
            eng.add_request("late", PROMPTS[1], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert len(checked) > 10
    # A steady row changes once per 4 tokens: most loads build few rows, some none.
    assert sum(w for _, w in checked) < sum(b for b, _ in checked) / 2, checked
    assert any(w == 0 for _, w in checked), checked
