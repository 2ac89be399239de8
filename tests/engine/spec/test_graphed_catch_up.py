"""engine/spec/graphed_catch_up.py: the MTP catch-up through static padded shapes (eager on CPU).

It must leave every sequence in the state the eager catch-up leaves: the same committed counts,
the same hidden rows handed on, the same latent entries in each module's cache. Small shapes
force the awkward cases: more sequences than a shape holds, more rows than the largest shape
(several passes), deeper modules' band masks and per-row context limits, a second catch-up over
rows that already have cache entries before them, and padding that must leave nothing behind.
Sequences whose rows fit one pass take the fused replay (all modules at once, carried rows and
all), the others the per-module passes; each case checks which ran how often.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.kv.block_pool import BlockOwner
from engine.sequence import SeqStatus, Sequence
from engine.spec.graphed_catch_up import GraphedCatchUp
from tests.model_factory import build_checkpoint

SHAPES = ((1, 4), (2, 4), (1, 8), (2, 8))  # at most 2 sequences and 8 rows per replay
LENGTHS = (3, 21, 9, 5)  # committed tokens per sequence (the prompt); 21 needs three passes
MORE = (1, 6, 12, 3)  # committed later (autoregressive steps), caught up a second time
# Steady case: tokens a speculative step accepted (None: the sequence, with fewer tokens than
# modules, was not drafted for), then autoregressive steps; the third sequence is caught up
# right after the step (its rows still deferred), the last one with its two newest target rows
# not queued yet (logged, ``HiddenLog``), so its module 1 stops a row short and module 2 takes
# all of module 1's new rows.
ACCEPTED = (None, 4, 3, 3)
STEADY_MORE = (1, 6, 0, 3)
# (fused replays, per-module replays) of each case's last catch-up (module d of sequence i has
# LENGTHS[i] - d rows in the prompt's, MORE[i] (+ ACCEPTED[i] + 1) in a later one; a sequence
# with more than 8 rows for a module takes per-module passes of at most 8 rows, the others go
# fused, 2 sequences per replay at most).
RUNS = {"prompt": (2, 12), "prompt+lag": (2, 8), "steady": (2, 8)}


@pytest.fixture(scope="module", params=["dense", "moe"])
def four_module_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four MTP modules: the last module's rows only write KV, so the per-row context limits of
    deeper modules (depth 3) show in what the next module reads only when there is a fourth.
    The MoE variant routes the padding rows too (their outputs must not reach real rows)."""
    moe = {"n_routed_experts": 4, "first_k_dense_replace": 1} if request.param == "moe" else {}
    return build_checkpoint(tmp_path_factory.mktemp(f"v6k4{request.param}"), seed=3, vocab_size=6,
                            num_nextn_predict_layers=4, **moe)


def _rows(count: int, eng: LLMEngine, gen: torch.Generator) -> torch.Tensor:
    """``count`` random hidden rows [count, H] on the engine's device."""
    return torch.randn(count, eng.model_config.hidden_size, generator=gen).to(eng.device)


def _sequences(eng: LLMEngine, gen: torch.Generator, owner: str) -> list[Sequence]:
    cfg = eng.model_config
    seqs = []
    for i, length in enumerate(LENGTHS):
        tokens = torch.randint(0, cfg.vocab_size, (length + 4 + max(MORE) + 1,), generator=gen).tolist()
        seq = Sequence(f"{owner}-{i}", tokens[: length + 1], SamplingParams(), gen,
                       num_mtp_modules=cfg.num_mtp_modules)  # fmt: skip
        seq.status = SeqStatus.RUNNING
        seq.block_ids = eng.pool.allocate(-(-len(tokens) // eng.pool.block_size) + 1, BlockOwner(owner))
        seq.num_committed = length
        seq.push_hidden(0, 0, _rows(length, eng, gen))
        seq.future = tokens[length + 1 :]  # type: ignore[attr-defined]
        seqs.append(seq)
    return seqs


def _commit(seq: Sequence, count: int, eng: LLMEngine, gen: torch.Generator, queued: int | None = None) -> None:
    """``count`` more committed tokens with ``queued`` (default: all) of their target rows queued."""
    start = seq.num_committed
    seq.tokens += seq.future[:count]  # type: ignore[attr-defined]
    seq.future = seq.future[count:]  # type: ignore[attr-defined]
    seq.num_committed += count
    seq.push_hidden(0, start, _rows(count if queued is None else queued, eng, gen))


class _StepOutputs:
    """A graphed step's copied outputs, which its sequences' pending rows stay in
    (``engine.sequence.DeferredHidden``)."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    def hidden_of(self, index: int) -> list[torch.Tensor]:
        return self.rows


def _speculative_step(seq: Sequence, accepted: int, eng: LLMEngine, gen: torch.Generator) -> None:
    """The state ``GraphedTreeStep._finish`` leaves a caught-up sequence in: every module's
    pending row committed (its entry is left out here: both runs lack it alike), and deferred
    (``Sequence.deferred``) ``accepted + 1`` target rows and each module d < k's output at L - d,
    carried for module d + 1."""
    L, k = seq.num_committed, seq.num_mtp_modules
    seq.mtp_committed = [m + 1 for m in seq.mtp_committed]
    seq.pending_start = [L - d for d in range(k)]
    seq.deferred = (_StepOutputs([_rows(accepted + 1, eng, gen), *(_rows(1, eng, gen) for _ in range(k - 1))]), 0)
    seq.tokens += seq.future[: accepted + 1]  # type: ignore[attr-defined]
    seq.future = seq.future[accepted + 1 :]  # type: ignore[attr-defined]
    seq.num_committed += accepted + 1


def _catch_up_case(eng: LLMEngine, seqs: list[Sequence], case: str) -> None:
    """Catch up after the prompt, then (but for ``prompt``) catch up again after more tokens."""
    assert eng.drafter is not None
    eng.drafter.catch_up(seqs)
    if case == "prompt":
        return
    gen = torch.Generator().manual_seed(1)
    steady = case == "steady"
    for seq, more, accepted in zip(seqs, STEADY_MORE if steady else MORE, ACCEPTED, strict=True):
        if steady and accepted is not None:
            _speculative_step(seq, accepted, eng, gen)
        if more:
            _commit(seq, more, eng, gen, queued=more - 2 if steady and seq is seqs[-1] else None)
    static = eng.drafter.static_catch_up
    if static is not None:  # count the last catch-up's runs only
        static.fused_runs = static.module_runs = 0
    eng.drafter.catch_up(seqs)


def _module_entries(eng: LLMEngine, seq: Sequence, depth: int) -> torch.Tensor:
    """Module ``depth``'s committed latent entries [n, latent], read from the cache."""
    bs = eng.pool.block_size
    slots = [seq.block_ids[p // bs] * bs + p % bs for p in range(seq.mtp_committed[depth - 1])]
    layer = eng.pool.kv_cache[eng.model.mtp_cache_layer(depth)].flatten(0, 1)
    return layer[torch.tensor(slots, dtype=torch.long, device=eng.device)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (captures the graphs)"))])  # fmt: skip
@pytest.mark.parametrize("case", list(RUNS))
def test_static_catch_up_equals_eager(four_module_dir: Path, case: str, device: str) -> None:
    eng = LLMEngine.from_pretrained(four_module_dir, device=device, spec=SpecConfig(method="tree"),
                                    engine_config=EngineConfig(cuda_graphs=False))  # fmt: skip
    assert eng.drafter is not None and eng.drafter.static_catch_up is None  # eager catch-up
    k = eng.model_config.num_mtp_modules
    assert k == 4
    if device == "cuda" and eng.model_config.n_routed_experts:
        # MoE routing reads its experts on the host: no capture (a failed one upsets later tests).
        pytest.skip("MoE modules are not captured")
    static = GraphedCatchUp(eng.model, eng.pool, max_blocks=8, max_batch=4, use_graphs=True, shapes=SHAPES)
    assert static.max_rows == 8 and static.use_graphs == (device == "cuda"), static.capture_error
    scratch = torch.tensor(static.scratch, device=eng.device)
    run_fused = static._run_fused

    def run_fused_checked(*args: Any) -> None:  # the per-module replays after it zero their layers
        run_fused(*args)
        assert eng.pool.kv_cache[:, scratch].abs().sum().item() == 0  # padding left nothing behind

    static._run_fused = run_fused_checked  # type: ignore[method-assign]
    eager_seqs = _sequences(eng, torch.Generator().manual_seed(0), "eager")
    static_seqs = _sequences(eng, torch.Generator().manual_seed(0), "static")
    _catch_up_case(eng, eager_seqs, case)
    eng.drafter.static_catch_up = static
    _catch_up_case(eng, static_seqs, case)
    assert (static.fused_runs, static.module_runs) == RUNS[case]
    for a, b in zip(eager_seqs, static_seqs, strict=True):
        L = len(a.tokens) - 1
        short = case == "steady" and a is eager_seqs[-1]  # its module 1 a row short
        assert b.mtp_committed == a.mtp_committed == [max(L - d - (short and d == 1), 0) for d in range(1, k + 1)]
        for depth in range(1, k + 1):
            torch.testing.assert_close(_module_entries(eng, b, depth), _module_entries(eng, a, depth))
        for depth in range(k):
            assert b.pending_start[depth] == a.pending_start[depth]
            torch.testing.assert_close(b.hidden_rows(depth), a.hidden_rows(depth))
    assert eng.pool.kv_cache[:, scratch].abs().sum().item() == 0
    eng.drafter.catch_up(static_seqs)  # nothing left to catch up: no replay
    assert (static.fused_runs, static.module_runs) == RUNS[case]


def test_engine_with_static_paths_catches_prompts_up_in_static_shapes(small_vocab_dir: Path) -> None:
    """The CUDA-graph configuration (eager on CPU) catches prompts up through GraphedCatchUp,
    and its scratch blocks count among the engine's static scratch."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"),
                                    engine_config=EngineConfig(cuda_graphs=True))  # fmt: skip
    static = eng.drafter.static_catch_up if eng.drafter is not None else None
    assert static is not None and set(static.scratch) <= set(eng.static_scratch_blocks)
    calls: list[int] = []
    run_fused = static._run_fused
    static._run_fused = lambda buf, work: calls.append(len(work)) or run_fused(buf, work)  # type: ignore[method-assign]
    base = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="none"))
    prompts = [[1, 2, 3, 4, 5, 0, 1] * 5, [2, 3, 1, 4, 0]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base.generate(prompts, params)]
    assert calls and calls[0] == 2  # both prompts, every module, in the first replay
    assert static.module_runs == 0  # nothing needed per-module replays


def test_a_prompt_behind_by_a_few_tokens_is_caught_up_64_sequences_a_replay(small_vocab_dir: Path) -> None:
    """A closed batch of 64-token prompts that decoded a few tokens while it filled is 65-70 rows
    behind: the default shapes take it 64 sequences per replay (rows bucket 128), not 16 (bucket
    256: the H200's batch 256 paid 16 padded replays in the first drafting step of each round)."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="tree"),
                                    engine_config=EngineConfig(cuda_graphs=True, max_batch_size=256))  # fmt: skip
    static = eng.drafter.static_catch_up if eng.drafter is not None else None
    assert static is not None and static.max_rows == 256
    assert static._shape_for(256, 64) == (64, 64)
    assert static._shape_for(256, 67) == (64, 128)
    assert static._shape_for(3, 100) == (4, 128)
    assert static._shape_for(16, 200) == (16, 256)
