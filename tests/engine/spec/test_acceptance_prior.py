"""engine/spec/acceptance_prior.py: what adaptive speculation expects before measuring."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from engine.spec.acceptance_prior import DEFAULT_PRIOR, MAX_DEPTH, TRAINING_LOG, acceptance_prior

REPO = Path(__file__).resolve().parents[3]


def _write_log(folder: Path, final: object) -> Path:
    (folder / TRAINING_LOG).write_text(json.dumps({"final_heldout": final}))
    return folder


def test_the_recipes_held_out_agreement_per_module_is_the_prior(tmp_path: Path) -> None:
    _write_log(tmp_path, {"accept_greedy": [0.8, 0.7], "accept_sampled": [0.6, 0.5, 0.4]})
    prior = acceptance_prior(tmp_path)
    greedy = [ranks[0] for ranks in prior[False].rank_accept]
    sampled = [ranks[0] for ranks in prior[True].rank_accept]
    assert greedy == [0.8] + [0.7] * (MAX_DEPTH - 1), "the last module's rate repeats (reused)"
    assert sampled == [0.6, 0.5] + [0.4] * (MAX_DEPTH - 2)
    assert all(len(ranks) == 1 for ranks in prior[False].rank_accept), "a chain: rank 0 only"


def test_the_greedy_prior_has_the_modules_ranks_where_the_log_has_them(tmp_path: Path) -> None:
    """A tree's siblings are valued from the start: with rank rates, the optimiser's tree for the
    default budget is predicted to yield more than the deepest chain, which a chain prior cannot
    tell apart from it."""
    from engine.simulator import TreeShape, expected_length, optimal_tree

    rows = [[0.79, 0.09, 0.035, 0.018], [0.77, 0.1, 0.04, 0.02]]
    _write_log(tmp_path, {"accept_greedy": [0.79, 0.77], "accept_sampled": [0.6],
                          "accept_greedy_rank": rows})  # fmt: skip
    prior = acceptance_prior(tmp_path)
    assert [list(r) for r in prior[False].rank_accept] == rows + [rows[-1]] * (MAX_DEPTH - 2)
    assert all(len(r) == 1 for r in prior[True].rank_accept), "the sampled prior stays a chain"
    chain_only = acceptance_prior(_write_log(tmp_path, {"accept_greedy": [0.79, 0.77], "accept_sampled": [0.6]}))
    for stats, tree_beats_chain in ((prior[False], True), (chain_only[False], False)):
        tree = expected_length(optimal_tree(stats, 32, 6, 4), stats)
        chain = expected_length(TreeShape.chain(6), stats)
        assert (tree > chain + 0.5) is tree_beats_chain, (tree, chain)


def test_the_shipped_demo_model_has_a_prior_of_its_own() -> None:
    prior = acceptance_prior(REPO / "models" / "demo")
    assert prior[False] != DEFAULT_PRIOR and prior[True] != DEFAULT_PRIOR
    assert all(0.5 < ranks[0] < 1.0 for ranks in prior[False].rank_accept)


def test_a_folder_without_a_training_log_gets_the_default(tmp_path: Path) -> None:
    assert acceptance_prior(tmp_path) == {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "JSONDecodeError"),
        (json.dumps({"history": []}), "KeyError"),
        (json.dumps({"final_heldout": {"accept_greedy": [], "accept_sampled": [0.5]}}), "non-empty"),
        (json.dumps({"final_heldout": {"accept_greedy": [1.5], "accept_sampled": [0.5]}}), r"\[0, 1\]"),
        (json.dumps({"final_heldout": {"accept_greedy": ["x"], "accept_sampled": [0.5]}}), "ValueError"),
        (json.dumps({"final_heldout": {"accept_greedy": [0.5], "accept_sampled": [0.5],
                                       "accept_greedy_rank": [[0.7, 0.5]]}}), "sum"),
        (json.dumps({"final_heldout": {"accept_greedy": [0.5], "accept_sampled": [0.5],
                                       "accept_greedy_rank": [0.7]}}), "rank rates"),
    ],
)
def test_an_unreadable_training_log_is_reported_and_the_default_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, problem: str
) -> None:
    (tmp_path / TRAINING_LOG).write_text(content)
    with caplog.at_level(logging.WARNING, logger="engine.spec.acceptance_prior"):
        assert acceptance_prior(tmp_path) == {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}
    assert TRAINING_LOG in caplog.text
    assert re.search(problem, caplog.text), caplog.text
