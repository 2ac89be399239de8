"""Smoke run of ``mtpserve bench offline`` on a tiny random model: the JSON is complete and the
modes agree on greedy tokens. No timing assertions: benchmarks print figures, tests check them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.records import FIELDS

TOP_LEVEL = ("date", "commit", "device", "model", "settings", "runs", "prompts", "check",
             "loadavg_start")


@pytest.fixture(scope="module")
def offline_result(tmp_path_factory: pytest.TempPathFactory, dense_model_dir: Path) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("bench") / "cpu-smoke.json"
    rc = main(["offline", "--model", str(dense_model_dir), "--device", "cpu", "--out", str(out),
               "--batch-sizes", "1,2", "--temperatures", "0,0.7", "--max-new-tokens", "6",
               "--prompt-tokens", "8", "--repeats", "1", "--min-sequences", "2", "--warmup-tokens", "2",
               "--modes", "chain,tree,adaptive,transformers,transformers-mtp", "--tree-budgets", "3",
               "--price-per-hour", "1.0", "--prefill-chunk-tokens", "16", "--no-progress"])
    return rc, json.loads(out.read_text()), out


def test_json_has_every_field(offline_result: tuple[int, dict, Path]) -> None:
    rc, doc, _ = offline_result
    assert rc == 0
    for key in TOP_LEVEL:
        assert key in doc, key
    assert doc["prompts"] == "synthetic"  # the random checkpoint has no training manifest
    # Every engine prefills 16 prompt tokens per step, not its default 512 (the value is recorded).
    assert doc["settings"]["prefill_chunk_tokens"] == 16
    assert doc["runs"]
    # Every engine mode's build, stage by stage (the adaptive one calibrates at start-up).
    assert {"ar", "chain", "tree-3", "adaptive"} <= set(doc["startup_s"])
    assert "kv_pool" in doc["startup_s"]["ar"] and "calibration" in doc["startup_s"]["adaptive"]
    assert all(v >= 0 for stages in doc["startup_s"].values() for v in stages.values())
    for run in doc["runs"]:
        assert set(FIELDS) <= set(run), set(FIELDS) - set(run)
    done = {(r["label"], r["batch_size"], r["temperature"]) for r in doc["runs"] if not r["skipped"]}
    for label in ("ar", "chain", "tree-3", "transformers"):
        for bs in (1, 2):
            for t in (0.0, 0.7):
                assert (label, bs, t) in done, (label, bs, t)
    ar = [r for r in doc["runs"] if r["label"] == "ar" and not r["skipped"]]
    assert all(r["mean_accepted_length"] == 1.0 and r["speedup_vs_ar"] == 1.0 for r in ar)
    for r in (r for r in doc["runs"] if not r["skipped"]):  # every timed round, in order
        assert len(r["round_ms"]) == r["repeats"] and all(ms > 0 for ms in r["round_ms"]), r
        if r["round_speedups"] is not None:
            assert min(r["round_speedups"]) == pytest.approx(r["speedup_vs_ar_min"], abs=1e-3), r
    spec = [r for r in doc["runs"] if r["mode"] in ("chain", "tree") and not r["skipped"]]
    assert all(r["mean_accepted_length"] >= 1.0 and r["tokens_per_s"] > 0 for r in spec)
    assert all(r["rollback_ms_per_step"] is not None and r["cost_per_million_tokens"] > 0 for r in spec)
    # Adaptive records say which budgets its decode steps took; a decode step per token at most.
    adaptive = [r for r in doc["runs"] if r["mode"] == "adaptive" and not r["skipped"]]
    assert adaptive and all(r["steps_per_arm"] for r in adaptive)
    assert all(0 < sum(r["steps_per_arm"].values()) <= 6 * r["repeats"] for r in adaptive)
    labels = {label for r in adaptive for label in r["steps_per_arm"]}
    assert all(label == "none" or label.startswith(("chain-", "tree-")) for label in labels), labels
    for r in adaptive:  # the arm costs it measured, if any yet, are those of the batch's bucket
        for c in r["arm_costs"] or []:
            assert max(round(c["batch_size"]), 1).bit_length() == r["batch_size"].bit_length(), c
            assert c["step_seconds"] > 0 and (c["arm"] == "none" or c["arm"].startswith(("chain-", "tree-")))
        for c in r["fill_costs"] or []:  # filling steps at decode batches up to its bucket
            assert max(round(c["batch_size"]), 1).bit_length() <= r["batch_size"].bit_length(), c
            assert c["step_seconds"] > 0 and c["steps"] >= 1


def test_modes_agree_on_greedy_tokens(offline_result: tuple[int, dict, Path]) -> None:
    _, doc, _ = offline_result
    assert doc["check_passed"]
    for label in ("chain", "tree-3", "transformers"):
        assert doc["check"][label]["match"], (label, doc["check"][label])
    greedy = [r for r in doc["runs"] if r["temperature"] == 0.0 and not r["skipped"]]
    assert all(r["greedy_match"] for r in greedy)


def test_small_batches_run_rounds_until_min_sequences(offline_result: tuple[int, dict, Path]) -> None:
    """--repeats 1 --min-sequences 2: batch 1 runs two rounds (two prompts), batch 2 one."""
    _, doc, _ = offline_result
    timed = [r for r in doc["runs"] if not r["skipped"]]
    assert {r["repeats"] for r in timed if r["batch_size"] == 1} == {2}
    assert {r["repeats"] for r in timed if r["batch_size"] == 2} == {1}


def test_unavailable_modes_say_why(offline_result: tuple[int, dict, Path]) -> None:
    _, doc, _ = offline_result
    # transformers reads MTP weights only at layer 61; the tiny model has 2 layers
    assert "61" in doc["skipped_modes"]["transformers-mtp"]
    for run in doc["runs"]:
        if run["label"] == "transformers-mtp":
            assert run["skipped"] and run["tokens_per_s"] is None


def test_report_from_json(offline_result: tuple[int, dict, Path]) -> None:
    _, _, path = offline_result
    assert main(["report", str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "| T | batch | mode |" in md and "tree-3" in md
    assert "decode steps per chosen budget" in md and "measured arm costs" in md and "filling steps | fill questions |" in md
    assert "- adaptive: " in md.split("Engine builds")[1].split("## Offline engine sweep")[0]
    assert (path.parent / f"{path.stem}-speedup.png").stat().st_size > 1000
    assert (path.parent / f"{path.stem}-acceptance.png").stat().st_size > 1000


def test_time_limit_skips_and_says_so(dense_model_dir: Path) -> None:
    from bench.offline import OfflineSettings, run_offline

    doc, ok = run_offline(OfflineSettings(model=str(dense_model_dir), batch_sizes=[1, 2],
                                          temperatures=[0.0], max_new_tokens=4, prompt_tokens=8,
                                          modes=["chain"], repeats=1, time_limit_s=0.0),
                          progress=False)
    assert ok and doc["check"]["chain"]["match"]  # the check runs before any time limit
    assert len(doc["runs"]) == 4
    assert all(r["skipped"].startswith("time limit") and r["tokens_per_s"] is None for r in doc["runs"])


def test_report_shows_the_start_up_calibration(offline_result: tuple[int, dict, Path], tmp_path: Path) -> None:
    """An adaptive engine on the graphed path (a GPU) times each captured step at start-up; the
    report tabulates it per batch size, the step's verify tokens beside each time."""
    _, doc, _ = offline_result
    rows = [{"arm": arm, "batch_size": b, "sampled": False, "step_ms": ms * b, "verify_tokens": b * n}
            for arm, ms, n in (("none", 1.2, 1), ("chain-4", 1.5, 5)) for b in (1, 256)]  # fmt: skip
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**doc, "arm_calibration": {"adaptive": rows}}))
    assert main(["report", str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "adaptive: start-up calibration" in md
    assert "| T | batch | none | chain-4 |" in md
    assert "| 0 | 256 | 307.20 (256) | 384.00 (1280) |" in md


def test_runs_carry_their_stall_counters(offline_result: tuple[int, dict, Path]) -> None:
    """Every timed record has the warm-up's counters and one entry per timed round (dicts of the
    non-zero counters: ``bench.stall_probe``)."""
    _, doc, _ = offline_result
    for r in (r for r in doc["runs"] if not r["skipped"]):
        assert isinstance(r["warmup_stalls"], dict), r["label"]
        assert len(r["stalls"]) == r["repeats"] and all(isinstance(d, dict) for d in r["stalls"])


def test_check_dtype_none_skips_the_check_and_says_so(dense_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "nocheck.json"
    rc = main(["offline", "--model", str(dense_model_dir), "--device", "cpu", "--out", str(out),
               "--batch-sizes", "1", "--temperatures", "0", "--max-new-tokens", "4",
               "--prompt-tokens", "8", "--repeats", "1", "--min-sequences", "1", "--warmup-tokens", "2",
               "--modes", "chain", "--tree-budgets", "3", "--check-dtype", "none", "--no-progress",
               "--spin-ms", "20"])  # a GPU's spin before each run: a no-op on the CPU, but said
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["check"] == {} and doc["check_dtype"] == "none"
    assert {r["label"] for r in doc["runs"] if not r["skipped"]} == {"ar", "chain"}
    md = out.with_suffix(".md").read_text()
    assert "Skipped on request (--check-dtype none)" in md
    assert doc["settings"]["spin_ms"] == 20.0 and "each run after 20 ms of GPU matrix products" in md


def test_the_check_in_another_dtype_runs_the_timed_engines_configuration(
    dense_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float32 check before a bf16 sweep builds engines of its own: they prefill in the
    sweep's chunks and launch steps ahead as the sweep's do, so the check covers the paths timed."""
    import bench.offline as offline

    configs: list[tuple[str, int, bool]] = []
    load = offline.load_base

    def recorded(*args: object, **kwargs: object) -> object:
        eng = load(*args, **kwargs)  # type: ignore[arg-type]
        configs.append((str(args[2]), eng.scheduler.prefill_chunk_tokens, eng.overlap_steps))
        return eng

    monkeypatch.setattr(offline, "load_base", recorded)
    settings = offline.OfflineSettings(
        model=str(dense_model_dir), dtype="bfloat16", check_dtype="float32", batch_sizes=[2],
        temperatures=[0.0], max_new_tokens=4, prompt_tokens=8, modes=["chain"], repeats=1,
        time_limit_s=0.0, prefill_chunk_tokens=16, overlap_steps=True,
    )
    doc, ok = offline.run_offline(settings, progress=False)
    assert ok and doc["check"]["chain"]["match"]
    assert configs == [("bfloat16", 16, True), ("float32", 16, True)]


def test_prompt_offset_and_adaptive_tree_are_run_and_said(dense_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "offset.json"
    rc = main(["offline", "--model", str(dense_model_dir), "--device", "cpu", "--out", str(out),
               "--batch-sizes", "1", "--temperatures", "0", "--max-new-tokens", "4",
               "--prompt-tokens", "8", "--repeats", "1", "--num-prompts", "2", "--warmup-tokens", "2",
               "--modes", "adaptive", "--adaptive-tree", "2x2-3", "--adaptive-chains", "2,3",
               "--prompt-offset", "5", "--no-progress"])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["num_prompts"] == 2
    assert doc["settings"]["prompt_offset"] == 5 and doc["settings"]["adaptive_tree"] == "2x2-3"
    assert doc["settings"]["adaptive_chains"] == [2, 3]
    assert {r["label"] for r in doc["runs"] if not r["skipped"]} == {"ar", "adaptive"}
    md = out.with_suffix(".md").read_text()
    assert "(after the first 5)" in md and "adaptive's tree arm 2x2-3" in md
    assert "adaptive's chain arms [2, 3]" in md


def test_a_batch_1_run_decodes_min_sequences_distinct_prompts(dense_model_dir: Path, tmp_path: Path) -> None:
    """Without --num-prompts the pool holds max(largest batch, --min-sequences) prompts, so the
    rounds of a batch-1-only run decode different prompts, not one prompt again and again."""
    out = tmp_path / "b1.json"
    rc = main(["offline", "--model", str(dense_model_dir), "--device", "cpu", "--out", str(out),
               "--batch-sizes", "1", "--temperatures", "0", "--max-new-tokens", "3",
               "--prompt-tokens", "8", "--repeats", "1", "--min-sequences", "3", "--warmup-tokens", "2",
               "--modes", "chain", "--check-dtype", "none", "--no-progress", "--no-report"])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["num_prompts"] == 3
    assert {r["repeats"] for r in doc["runs"] if not r["skipped"]} == {3}
