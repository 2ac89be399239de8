"""`mtpserve eval` on a tiny trained model: every figure present and sane, greedy modes lossless,
and the simulator reads the acceptance statistics it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.cli import main as mtpserve_main
from engine.simulator.acceptance import AcceptanceStats
from tests.train.conftest import write_corpus
from train.cli import main as train_main
from train.eval_cli import MODES, main
from train.eval_metrics import repeated_ngram_counts, repeated_ngram_share, summarize_outputs
from train.eval_teacher import reference_windows


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_corpus(tmp_path_factory.mktemp("src"), num_files=20)
    out = tmp_path_factory.mktemp("run") / "model"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    argv = ["--preset", "tiny", "--out", str(out), "--corpus-root", f"src={root}"]
    argv += ["--joint-steps", "5", "--distill-steps", "2", "--device", "cpu", "--no-progress"]
    assert train_main(argv) == 0
    torch.set_num_threads(before)
    return out


@pytest.fixture(scope="module")
def evaluated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("eval")
    argv = ["--model", str(tiny_model), "--out", str(work / "eval.json")]
    argv += ["--stats-out", str(work / "stats.json"), "--prompts", "2", "--max-tokens", "12"]
    argv += ["--prompt-tokens", "24", "--ppl-tokens", "600", "--ppl-files", "4", "--seq-len", "128"]
    argv += ["--timing-rounds", "1"]
    assert mtpserve_main(["eval", *argv]) == 0  # through the real `mtpserve` dispatcher
    result = json.loads((work / "eval.json").read_text())
    result["_stats_path"] = str(work / "stats.json")
    return result


def test_teacher_forced_figures_are_sane(evaluated: dict[str, Any]) -> None:
    teacher = evaluated["teacher_forced"]
    assert teacher["tokens"] > 0 and teacher["seq_len"] == 128
    assert 1.0 < teacher["perplexity"] < 512 * 4  # a 512-token vocabulary, barely trained
    assert len(teacher["greedy_agreement"]) == 3  # the tiny preset has 3 MTP modules
    for name in ("greedy_agreement", "sampled_acceptance"):
        assert all(0.0 <= a <= 1.0 for a in teacher[name]), name


def test_every_mode_is_reported_and_greedy_modes_match_ar(evaluated: dict[str, Any]) -> None:
    assert set(evaluated["modes"]) == {m.name for m in MODES}
    assert evaluated["greedy_identical_to_ar"] is True
    assert evaluated["goals"]["greedy_identical_to_ar"]["met"] is True
    for name, run in evaluated["modes"].items():
        assert run["generated_tokens"] > 0, name
        assert run["tokens_per_s"] > 0 and run["batch1_tokens_per_s"] > 0, name
        assert 0.0 <= run["repeated_4gram_share"] <= 1.0, name
        assert all(0.0 <= p <= 1.0 for p in run["acceptance_per_position"]), name
        ranks = run["acceptance_per_position"]
        assert ranks == sorted(ranks, reverse=True), name  # reaching d+1 implies reaching d
        if run["method"] == "none":
            assert run["mean_accepted_length"] == 1.0 and run["num_draft_tokens"] == 0
        else:
            assert run["mean_accepted_length"] >= 1.0 and run["num_draft_tokens"] > 0, name
    assert evaluated["modes"]["ar@T0"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert evaluated["modes"]["ar@T0"]["batch1_speedup_vs_ar"] == pytest.approx(1.0)
    assert 0.0 <= evaluated["reference"]["repeated_4gram_share"] <= 1.0
    for goal in evaluated["goals"].values():
        assert isinstance(goal["met"], bool) and goal["goal"]


def test_simulator_reads_the_written_stats(evaluated: dict[str, Any]) -> None:
    from_file = AcceptanceStats.from_json(evaluated["_stats_path"])
    assert from_file == AcceptanceStats.from_dict(evaluated["simulator_stats"])
    assert from_file.num_depths >= 1


def test_bad_arguments_fail_clearly(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 250 prompt tokens + 100 new ones exceed the tiny model's 256 positions.
    argv = ["--model", str(tiny_model), "--prompts", "1", "--prompt-tokens", "250"]
    argv += ["--max-tokens", "100", "--ppl-tokens", "200", "--ppl-files", "2", "--seq-len", "64"]
    assert main(argv) == 2
    assert "context length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model), "--prompts", "0"])


def test_repeated_ngram_share_counts_only_earlier_repeats() -> None:
    assert repeated_ngram_counts([1, 2, 3, 4, 5, 6]) == (0, 3)
    # a loop of period 2: only the first 4-gram of each phase is new
    assert repeated_ngram_counts([7, 8] * 5) == (5, 7)
    assert repeated_ngram_counts([1, 2, 3]) == (0, 0)
    assert repeated_ngram_share([[1, 2, 3, 4, 5, 6], [7, 8] * 5]) == pytest.approx(5 / 10)
    assert reference_windows([list(range(10)), [1, 2]], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_summary_pools_requests() -> None:
    class Stats:
        def __init__(self, steps: int, drafted: int, accepted: int, per: list[int]) -> None:
            self.num_steps, self.num_draft_tokens = steps, drafted
            self.num_accepted_tokens, self.accepted_per_position = accepted, per

    class Out:
        def __init__(self, n: int, stats: Stats) -> None:
            self.token_ids, self.finish_reason, self.stats = list(range(n)), "length", stats

    summary = summarize_outputs([Out(7, Stats(2, 8, 5, [2, 2, 1])), Out(3, Stats(2, 8, 1, [1]))])
    assert summary["generated_tokens"] == 10 and summary["num_steps"] == 4
    assert summary["mean_accepted_length"] == pytest.approx(1 + 6 / 4)
    assert summary["acceptance_per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert summary["draft_acceptance_rate"] == pytest.approx(6 / 16)
    assert summary["finish_reasons"] == {"length": 2}


def test_the_written_stats_carry_the_prompts_spread_for_closed_batches(
    evaluated: dict[str, Any], tmp_path: Path
) -> None:
    from engine.simulator.cli import main as simulate
    from engine.spec.drain import QUANTILES

    yields = evaluated["simulator_stats"]["relative_yields"]
    assert len(yields) == QUANTILES and yields == sorted(yields) and all(y > 0 for y in yields)
    latency = Path(__file__).parents[2] / "engine" / "simulator" / "examples" / "latency_example.json"
    rc = simulate(["--stats", str(evaluated["_stats_path"]), "--latency", str(latency), "--budget", "4",
                   "--batch-sizes", "1", "8", "--closed-batch-tokens", "32", "--out", str(tmp_path / "s.png")])  # fmt: skip
    assert rc == 0
