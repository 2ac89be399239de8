"""``mtpserve simulate`` end to end on the shipped examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.simulator.cli import main

EXAMPLES = Path(__file__).parents[3] / "engine" / "simulator" / "examples"


def test_cli_prints_the_table_and_writes_the_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.png"
    measured = tmp_path / "runs.json"
    measured.write_text(json.dumps([{"tree": "chain:3", "mean_accepted_length": 2.3}]))
    rc = main(
        [
            "--stats", str(EXAMPLES / "stats_example.json"),
            "--latency", str(EXAMPLES / "latency_example.json"),
            "--budget", "16",
            "--batch-sizes", "1", "8", "64",
            "--tree", "kary:2:6",
            "--measured", str(measured),
            "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "speedup" in line and "budget" in line)
    assert header.split() == [
        "batch", "budget", "depth", "topk", "E[len]", "tokens/s", "AR", "tok/s", "speedup"
    ]  # fmt: skip
    rows = text.splitlines()[text.splitlines().index(header) + 1 :][:3]
    assert [int(r.split()[0]) for r in rows] == [1, 8, 64]
    assert all(0 <= int(r.split()[1]) <= 16 for r in rows)
    assert float(rows[0].split()[-1]) > 1.0  # the example's speculation pays at batch 1
    assert "Given tree kary:2:6" in text and "mean |error|: length" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_cli_reports_bad_input_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "stats.json"
    bad.write_text(json.dumps({"rank_accept": [[0.9, 0.3]]}))
    rc = main(["--stats", str(bad), "--latency", str(EXAMPLES / "latency_example.json")])
    assert rc == 2
    assert "sums to 1.2" in capsys.readouterr().err
    assert not (tmp_path / "simulate.png").exists()


def test_cli_predicts_closed_batches_from_a_live_snapshots_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stats file that is an ``/admin/acceptance`` snapshot (counters and relative yields):
    the closed-batch table comes from its spread, and lies below the steady speedups."""
    snapshot = tmp_path / "acceptance.json"
    snapshot.write_text(json.dumps({
        "num_steps": 100, "depth_reached": [100, 80, 60],
        "depth_rank_accepted": [[80], [60], [40]],
        "relative_yields": [0.5, 0.8, 1.0, 1.2, 1.5],
    }))  # fmt: skip
    args = ["--stats", str(snapshot), "--latency", str(EXAMPLES / "latency_example.json"),
            "--budget", "8", "--batch-sizes", "1", "64", "--out", str(tmp_path / "s.png")]  # fmt: skip
    assert main([*args, "--closed-batch-tokens", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steady_header = next(i for i, line in enumerate(lines) if "budget" in line and "speedup" in line)
    closed_title = next(i for i, line in enumerate(lines) if line.startswith("Closed batches of 64"))
    steady = [float(line.split()[-1]) for line in lines[steady_header + 1 : steady_header + 3]]
    closed = [float(line.split()[-1]) for line in lines[closed_title + 2 : closed_title + 4]]
    assert "5 relative yields" in lines[closed_title]
    assert all(0 < c < s for c, s in zip(closed, steady, strict=True)), (steady, closed)


def test_cli_closed_batches_need_a_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--stats", str(EXAMPLES / "stats_example.json"),
               "--latency", str(EXAMPLES / "latency_example.json"),
               "--closed-batch-tokens", "64", "--out", str(tmp_path / "s.png")])  # fmt: skip
    assert rc == 2
    assert "no 'relative_yields' list" in capsys.readouterr().err
