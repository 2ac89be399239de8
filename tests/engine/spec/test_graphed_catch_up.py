"""engine/spec/graphed_catch_up.py: the MTP catch-up through static padded shapes (eager on CPU).

It must leave every sequence in the state the eager catch-up leaves: the same committed counts,
the same hidden rows handed on, the same latent entries in each module's cache. Small shapes
force the awkward cases: more sequences than a shape holds, more rows than the largest shape
(several passes), deeper modules' band masks and per-row context limits, a second catch-up over
rows that already have cache entries before them, and padding that must leave nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.kv.block_pool import BlockOwner
from engine.sequence import SeqStatus, Sequence
from engine.spec.graphed_catch_up import GraphedCatchUp
from tests.model_factory import build_checkpoint

SHAPES = ((1, 4), (2, 4), (1, 8), (2, 8))  # at most 2 sequences and 8 rows per replay
LENGTHS = (3, 21, 9)  # committed tokens per sequence (the prompt); 21 needs three passes
MORE = (1, 6, 12)  # committed later (autoregressive steps), caught up a second time


@pytest.fixture(scope="module", params=["dense", "moe"])
def four_module_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four MTP modules: the last module's rows only write KV, so the per-row context limits of
    deeper modules (depth 3) show in what the next module reads only when there is a fourth.
    The MoE variant routes the padding rows too (their outputs must not reach real rows)."""
    moe = {"n_routed_experts": 4, "first_k_dense_replace": 1} if request.param == "moe" else {}
    return build_checkpoint(tmp_path_factory.mktemp(f"v6k4{request.param}"), seed=3, vocab_size=6,
                            num_nextn_predict_layers=4, **moe)


def _sequences(eng: LLMEngine, gen: torch.Generator, owner: str) -> list[Sequence]:
    cfg = eng.model_config
    seqs = []
    for i, length in enumerate(LENGTHS):
        tokens = torch.randint(0, cfg.vocab_size, (length + max(MORE) + 1,), generator=gen).tolist()
        seq = Sequence(f"{owner}-{i}", tokens[: length + 1], SamplingParams(), gen,
                       num_mtp_modules=cfg.num_mtp_modules)  # fmt: skip
        seq.status = SeqStatus.RUNNING
        seq.block_ids = eng.pool.allocate(-(-len(tokens) // eng.pool.block_size) + 1, BlockOwner(owner))
        seq.num_committed = length
        seq.push_hidden(0, 0, torch.randn(length, cfg.hidden_size, generator=gen))
        seq.future = tokens[length + 1 :]  # type: ignore[attr-defined]
        seqs.append(seq)
    return seqs


def _commit_more(seqs: list[Sequence], gen: torch.Generator, hidden_size: int) -> None:
    """What autoregressive steps leave: more committed tokens, their target rows queued."""
    for seq, more in zip(seqs, MORE, strict=True):
        start = seq.num_committed
        seq.tokens += seq.future[:more]  # type: ignore[attr-defined]
        seq.num_committed += more
        seq.push_hidden(0, start, torch.randn(more, hidden_size, generator=gen))


def _module_entries(eng: LLMEngine, seq: Sequence, depth: int) -> torch.Tensor:
    """Module ``depth``'s committed latent entries [n, latent], read from the cache."""
    bs = eng.pool.block_size
    slots = [seq.block_ids[p // bs] * bs + p % bs for p in range(seq.mtp_committed[depth - 1])]
    layer = eng.pool.kv_cache[eng.model.mtp_cache_layer(depth)].flatten(0, 1)
    return layer[torch.tensor(slots, dtype=torch.long)]


@pytest.mark.parametrize("second_round", [False, True], ids=["prompt", "prompt+lag"])
def test_static_catch_up_equals_eager(four_module_dir: Path, second_round: bool) -> None:
    eng = LLMEngine.from_pretrained(four_module_dir, spec=SpecConfig(method="tree"))
    assert eng.drafter is not None and eng.drafter.static_catch_up is None  # CPU default: eager
    k = eng.model_config.num_mtp_modules
    assert k == 4
    static = GraphedCatchUp(eng.model, eng.pool, max_blocks=8, max_batch=4, use_graphs=False, shapes=SHAPES)
    assert static.max_rows == 8
    eager_seqs = _sequences(eng, torch.Generator().manual_seed(0), "eager")
    static_seqs = _sequences(eng, torch.Generator().manual_seed(0), "static")
    runs = [(eager_seqs, None), (static_seqs, static)]
    for seqs, runner in runs:
        eng.drafter.static_catch_up = runner
        eng.drafter.catch_up(seqs)
        if second_round:
            _commit_more(seqs, torch.Generator().manual_seed(1), eng.model_config.hidden_size)
            eng.drafter.catch_up(seqs)
    for a, b in zip(eager_seqs, static_seqs, strict=True):
        L = len(a.tokens) - 1
        assert b.mtp_committed == a.mtp_committed == [max(L - d, 0) for d in range(1, k + 1)]
        for depth in range(1, k + 1):
            torch.testing.assert_close(_module_entries(eng, b, depth), _module_entries(eng, a, depth))
        for depth in range(k):
            assert b.pending_start[depth] == a.pending_start[depth]
            torch.testing.assert_close(b.hidden_rows(depth), a.hidden_rows(depth))
    scratch = torch.tensor(static.scratch)
    assert eng.pool.kv_cache[:, scratch].abs().sum().item() == 0  # padding left nothing behind


def test_engine_with_static_paths_catches_prompts_up_in_static_shapes(small_vocab_dir: Path) -> None:
    """The CUDA-graph configuration (eager on CPU) catches prompts up through GraphedCatchUp,
    and its scratch blocks count among the engine's static scratch."""
    from engine import EngineConfig

    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"),
                                    engine_config=EngineConfig(cuda_graphs=True))  # fmt: skip
    static = eng.drafter.static_catch_up if eng.drafter is not None else None
    assert static is not None and set(static.scratch) <= set(eng.static_scratch_blocks)
    calls: list[int] = []
    run = static.run
    static.run = lambda module, work: calls.append(len(work)) or run(module, work)  # type: ignore[method-assign]
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    prompts = [[1, 2, 3, 4, 5, 0, 1] * 5, [2, 3, 1, 4, 0]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base.generate(prompts, params)]
    assert calls and calls[0] == 2  # both prompts, module 1, in the first replay
