"""bench/report.py: the adaptive table shows what the controller chose by, filling steps and the
fill questions too."""

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
        "fill_questions": [
            {"batch_size": 64, "sampled": False, "answer": "chain-4", "arm": "chain-4", "saving_ms": 38.04,
             "catch_up_ms": 3.3, "drain_ms": 5.21, "margin": 1.0},
            {"batch_size": 64, "sampled": False, "answer": None, "arm": None},
        ],
    }  # fmt: skip
    lines = adaptive_table([run])
    assert lines[2] == ("| T | batch | steps per budget | measured arm costs | filling steps | fill questions "
                        "| saved ms |")
    row = lines[-1]
    assert row.startswith("| 0 | 64 | none 35, tree-4x6-32 11 | none 1.01 ms (1.00) |")
    assert row.endswith("| 6: tree-4x6-32 3.10 ms (9); 6: none 1.50 ms (3) "
                        "| 64: chain-4 [chain-4 38.0/(3.3+5.2)x1.00]; 64: none | – |")
    assert "500" not in row and "9.00" not in row  # the sampled entries belong to T > 0 rows
    assert adaptive_table([{**run, "fill_costs": None, "fill_questions": None}])[-1].endswith("| – | – | – |")
    # With the baseline's rounds of the same point: the median of the paired differences.
    ar = {"mode": "ar", "temperature": 0.0, "batch_size": 64, "round_ms": [60.0, 62.0, 70.0]}
    paired = adaptive_table([{**run, "mode": "adaptive", "round_ms": [50.0, 64.0, 58.0]}, ar])
    assert paired[-1].endswith("| 10.0 |")  # 10, -2, 12


def test_a_fill_question_is_recorded_with_the_terms_it_weighed() -> None:
    """``MeasuredArms.drafting_arm`` keeps each question for diagnosis: the batch asked about,
    the answer, and the saving, catch-up, drain and margin it weighed (none where too little was
    known to weigh anything); asking changes no choice."""
    from engine.spec.adaptive import budget_label
    from engine.spec.arms import MeasuredArms
    from engine.spec.drafter import TreeBudget

    no_spec, chain = TreeBudget(topk=1, depth=0, num_draft_tokens=0), TreeBudget(topk=1, depth=4, num_draft_tokens=4)
    arms = MeasuredArms(explore_every=10_000)
    assert arms.drafting_arm(64, False, [no_spec, chain], 6400, 200) is None  # nothing measured yet
    for _ in range(3):
        arms.observe(64, False, no_spec, 0.010, 64)
        arms.observe(64, False, chain, 0.026, 200)
    arms.catch_up.calibrate([(64, 0.004), (6400, 0.012)])
    assert arms.drafting_arm(64, False, [no_spec, chain], 6400, 200) == chain
    first, second = (q.to_dict(budget_label) for q in arms.fill_questions)
    assert first == {"batch_size": 64, "sampled": False, "answer": None, "arm": None}
    assert second["answer"] == second["arm"] == "chain-4" and second["margin"] == 1.0
    assert second["catch_up_ms"] == 12.0 and second["saving_ms"] > second["catch_up_ms"] + second["drain_ms"]
    assert arms.fill_questions_asked == 2
