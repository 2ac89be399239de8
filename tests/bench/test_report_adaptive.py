"""bench/report.py: the adaptive table shows what the controller chose by, filling steps too."""

from __future__ import annotations

from bench.report import adaptive_table


def test_the_adaptive_table_lists_steady_and_filling_costs_of_the_rows_temperature() -> None:
    run = {
        "temperature": 0.0, "batch_size": 64, "steps_per_arm": {"none": 35, "tree-4x6-32": 11},
        "arm_costs": [
            {"arm": "none", "step_seconds": 0.00101, "tokens_per_seq": 1.0, "sampled": False},
            {"arm": "none", "step_seconds": 0.009, "tokens_per_seq": 1.0, "sampled": True},
        ],
        "fill_costs": [
            {"batch_size": 6.0, "arm": "tree-4x6-32", "step_seconds": 0.0031, "steps": 9, "sampled": False},
            {"batch_size": 6.0, "arm": "none", "step_seconds": 0.0015, "steps": 3, "sampled": False},
            {"batch_size": 6.0, "arm": "none", "step_seconds": 0.5, "steps": 3, "sampled": True},
        ],
    }  # fmt: skip
    lines = adaptive_table([run])
    assert lines[2] == "| T | batch | steps per budget | measured arm costs | filling steps |"
    row = lines[-1]
    assert row.startswith("| 0 | 64 | none 35, tree-4x6-32 11 | none 1.01 ms (1.00) |")
    assert row.endswith("| 6: tree-4x6-32 3.10 ms (9); 6: none 1.50 ms (3) |")
    assert "500" not in row and "9.00" not in row  # the sampled entries belong to T > 0 rows
    assert adaptive_table([{**run, "fill_costs": None}])[-1].endswith("| – |")
