"""engine/spec/hidden_log.py: autoregressive steps' hidden rows, handed out when read.

Unit: rows reach the right sequences at the right hidden indices, finished sequences' rows
are dropped, a full log hands its rows out. Engine: adaptive speculation switching between
autoregressive runs (logged) and speculative steps (which read the MTP state), across a
session's turns and requests finishing at different steps, keeps the autoregressive tokens.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.sequence import SeqStatus, Sequence
from engine.spec.adaptive import NO_SPEC
from engine.spec.hidden_log import HiddenLog

H = 3


def _seq(name: str, committed: int) -> Sequence:
    seq = Sequence(name, list(range(committed + 1)), SamplingParams(), None, num_mtp_modules=2)  # type: ignore[arg-type]
    seq.status = SeqStatus.RUNNING
    seq.push_hidden(0, 0, torch.full((committed, H), -1.0))  # its prompt's rows
    seq.num_committed = committed
    return seq


def _step(log: HiddenLog, seqs: list[Sequence], step: int) -> None:
    """An autoregressive step: row i is ``100 * step + i``; every sequence commits one token."""
    hidden = (100.0 * step + torch.arange(len(seqs), dtype=torch.float32))[:, None].expand(-1, H)
    for seq in seqs:
        seq.num_committed += 1
    log.append(seqs, hidden.clone())


def test_flush_hands_each_sequence_its_rows_at_its_newest_positions() -> None:
    a, b, c = _seq("a", 4), _seq("b", 2), _seq("c", 6)
    log = HiddenLog()
    _step(log, [a, b], 0)
    _step(log, [b, a, c], 1)  # the order of a batch may change; c joins
    b.status = SeqStatus.FINISHED  # b's rows must not be handed out (nor fail)
    _step(log, [c, a], 2)
    assert len(log) == 3
    log.flush()
    assert len(log) == 0
    rows_a = a.hidden_rows(0)
    assert rows_a is not None and rows_a.shape == (7, H) and a.pending_start[0] == 0
    assert rows_a[4:, 0].tolist() == [0.0, 101.0, 201.0]  # hidden indices 4, 5, 6
    rows_c = c.hidden_rows(0)
    assert rows_c is not None and rows_c[6:, 0].tolist() == [102.0, 200.0]
    assert b.hidden_rows(0) is not None and b.hidden_rows(0).shape[0] == 2  # type: ignore[union-attr]
    _step(log, [a], 3)  # logging goes on after a flush
    log.flush()
    rows_a = a.hidden_rows(0)
    assert rows_a is not None and rows_a[-1, 0].item() == 300.0 and rows_a.shape[0] == 8


def test_runs_of_steps_over_one_batch_keep_each_sequences_rows_in_order() -> None:
    """Consecutive steps over the same batch are logged as one run (``[a, b]`` three times, a
    new list of the same sequences each time); rows still reach each sequence oldest first
    across runs whose batch changed."""
    a, b, c = _seq("a", 1), _seq("b", 1), _seq("c", 1)
    log = HiddenLog()
    for step in range(3):
        _step(log, [a, b], step)
    for step in range(3, 5):
        _step(log, [b, a, c], step)
    _step(log, [c, a], 5)
    assert len(log._runs) == 3 and len(log) == 6
    log.flush()
    assert a.hidden_rows(0)[1:, 0].tolist() == [0.0, 100.0, 200.0, 301.0, 401.0, 501.0]  # type: ignore[index]
    assert b.hidden_rows(0)[1:, 0].tolist() == [1.0, 101.0, 201.0, 300.0, 400.0]  # type: ignore[index]
    assert c.hidden_rows(0)[1:, 0].tolist() == [302.0, 402.0, 500.0]  # type: ignore[index]


def test_a_full_log_hands_its_rows_out() -> None:
    a = _seq("a", 1)
    log = HiddenLog(max_steps=4)
    for step in range(6):
        _step(log, [a], step)
    assert len(log) == 2  # flushed at the fourth step
    rows = a.hidden_rows(0)
    assert rows is not None and rows[1:, 0].tolist() == [0.0, 100.0, 200.0, 300.0]


def test_rows_out_of_place_are_refused() -> None:
    """A sequence whose logged rows are not its newest committed positions (something committed
    tokens without flushing first) trips the queue's order check, not silently misplaced rows."""
    a = _seq("a", 3)
    log = HiddenLog()
    _step(log, [a], 0)
    a.push_hidden(0, 3, torch.zeros(1, H))  # index 3 pushed behind the log's back
    with pytest.raises(AssertionError, match="out of order"):
        log.flush()


def test_holds_tells_which_sequences_have_logged_rows() -> None:
    a, b, c = _seq("a", 4), _seq("b", 2), _seq("c", 6)
    log = HiddenLog()
    _step(log, [a, b], 0)
    _step(log, [b], 1)
    assert log.holds(a) and log.holds(b) and not log.holds(c)
    log.flush()
    assert not log.holds(a) and not log.holds(b)


GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def test_a_new_request_prefilling_leaves_the_log_as_it_is(small_vocab_dir: Path) -> None:
    """Only a prefill of a sequence the log holds (a session's next turn) hands the rows out
    first: new requests joining a batch decoding autoregressively do not."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    eng.adaptive.choose = lambda *a, **k: NO_SPEC  # type: ignore[method-assign]
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [2, 3, 1])):
        eng.add_request(f"r{i}", prompt, GREEDY)
    for _ in range(4):
        eng.step()
    logged = len(eng._hidden_log)
    assert logged >= 2
    eng.add_request("late", [4, 4, 1], GREEDY)
    eng.step()  # the late request's prefill, and an autoregressive step of the others
    assert len(eng._hidden_log) == logged + 1, "the log was flushed for a new request"


@pytest.mark.parametrize(
    "cfg", [EngineConfig(), EngineConfig(cuda_graphs=True)], ids=["host", "static"]
)
def test_adaptive_with_logged_rows_keeps_the_autoregressive_tokens(
    small_vocab_dir: Path, cfg: EngineConfig
) -> None:
    """Runs of autoregressive steps (logged rows) between speculative steps, requests finishing
    at different steps, and a session whose second turn continues from logged rows: the tokens
    are the autoregressive ones. Drafts read the handed-out rows, so they are the ones a log
    handing out every step at once gives (misplaced rows cost acceptance, not tokens)."""
    prompts = [[1, 2, 3, 4, 5, 0, 1], [2, 3, 1, 4, 0], [4] * 12]
    lengths = [30, 11, 23]

    def run(
        spec: SpecConfig, log_steps: int = 256
    ) -> tuple[list[list[int]], list[list[int]], int, int]:
        eng = LLMEngine.from_pretrained(small_vocab_dir, spec=spec, engine_config=cfg)
        eng._hidden_log.max_steps = log_steps
        logged = accepted = 0
        if eng.adaptive is not None:
            arms = [NO_SPEC, NO_SPEC, NO_SPEC, eng.budget, NO_SPEC, NO_SPEC, eng.budget, eng.budget]
            picks = itertools.cycle(arms)
            eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
        for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            eng.add_request(f"r{i}", prompt, params)
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
                    accepted += o.stats.num_accepted_tokens
            logged = max(logged, len(eng._hidden_log))
        eng.open_session("s")
        turns = []
        for t, prompt in enumerate(([1, 2, 3, 4, 5], [0, 1, 2])):
            eng.add_request(f"turn-{t}", prompt, GREEDY, session_id="s")
            final = None
            while eng.has_unfinished_requests():
                for o in eng.step():
                    final = o if o.finished else final
                logged = max(logged, len(eng._hidden_log))
            assert final is not None
            turns.append(final.token_ids)
            accepted += final.stats.num_accepted_tokens
        return [outs[f"r{i}"] for i in range(len(prompts))], turns, logged, accepted

    base_outs, base_turns, _, _ = run(SpecConfig(method="none"))
    outs, turns, logged, accepted = run(SpecConfig(method="adaptive"))
    assert outs == base_outs and turns == base_turns
    assert logged >= 3
    *_, accepted_at_once = run(SpecConfig(method="adaptive"), log_steps=1)
    assert accepted == accepted_at_once > 0


def test_aborted_and_closed_sequences_leave_nothing_behind_in_the_log(small_vocab_dir: Path) -> None:
    """A request aborted and a session closed while their rows are logged: the next flush skips
    them, the engine goes on with another request, and every block is zeroed and free."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    eng.adaptive.choose = lambda *a, **k: NO_SPEC  # type: ignore[method-assign]
    eng.open_session("s")
    eng.add_request("a", [1, 2, 3, 4], GREEDY)
    eng.add_request("t", [2, 3, 4], GREEDY, session_id="s")
    for _ in range(5):
        eng.step()
    assert len(eng._hidden_log) >= 3
    eng.abort_request("a")
    eng.abort_request("t")
    eng.close_session("s")
    out = eng.generate([[3, 4, 5]], GREEDY)[0]  # its prefill flushes the log
    # Idle with no session open once it ends: its own rows, a finished request's, are dropped.
    assert len(out.token_ids) == GREEDY.max_tokens and len(eng._hidden_log) == 0
    assert eng.kv_blocks_used == 0
    assert torch.count_nonzero(eng.pool.kv_cache) == 0


def test_an_idle_engine_keeps_logged_rows_only_for_an_open_session(small_vocab_dir: Path) -> None:
    """Rows logged for requests that all finished are dropped once nothing runs or waits (a flush
    would drop them; kept, they hold device memory and make the next flush dear), unless a
    session is open: its next turn continues from them. A closed batch decoding
    autoregressively is logged as one run, its batch matched by the engine's key."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"))
    assert eng.adaptive is not None
    eng.adaptive.choose = lambda *a, **k: NO_SPEC  # type: ignore[method-assign]
    eng.add_request("a", [1, 2, 3, 4], GREEDY)
    eng.add_request("b", [2, 3, 4], GREEDY)
    while len(eng.sequence("a").output_ids) < 10:  # type: ignore[union-attr]
        eng.step()
    assert len(eng._hidden_log._runs) == 1 and len(eng._hidden_log) >= 5
    while eng.num_running or eng.num_waiting:
        eng.step()
    assert len(eng._hidden_log) == 0
    eng.open_session("s")
    eng.add_request("t", [2, 3, 4], GREEDY, session_id="s")
    while eng.num_running or eng.num_waiting:
        eng.step()
    assert len(eng._hidden_log) > 0  # the session's next turn reads them
    eng.close_session("s")


def test_a_step_whose_key_matches_the_last_joins_its_run_without_comparing_the_batch() -> None:
    """The engine keys each step's batch (its scheduler version and size): a step with the last
    step's key joins its run; a new key, or a batch whose ends are other sequences (a key
    reused wrongly), starts a new run, so every row still reaches its own sequence."""
    a, b, c = _seq("a", 1), _seq("b", 1), _seq("c", 1)
    log = HiddenLog()
    hidden = torch.zeros(2, H)
    log.append([a, b], hidden, key=(7, 2))
    log.append([a, b], hidden, key=(7, 2))
    assert len(log._runs) == 1
    log.append([a, c], hidden, key=(7, 2))  # same key, another batch: not trusted
    log.append([a, c], hidden, key=(8, 2))
    assert [len(h) for _, h in log._runs] == [2, 1, 1] and len(log) == 4
