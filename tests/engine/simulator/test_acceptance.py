"""AcceptanceStats: parsing, validation and estimation from engine counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.simulator.acceptance import AcceptanceStats


def test_depths_beyond_measured_reuse_the_last_and_unmeasured_ranks_are_zero() -> None:
    stats = AcceptanceStats(((0.7, 0.2), (0.5,)))
    assert stats.prob(0, 1) == 0.2
    assert stats.prob(1, 0) == 0.5
    assert stats.prob(7, 0) == 0.5
    assert stats.prob(7, 1) == 0.0
    assert stats.max_rank(0) == 2


def test_json_round_trip(tmp_path: Path) -> None:
    stats = AcceptanceStats(((0.7, 0.2), (0.5, 0.1)))
    stats.to_json(tmp_path / "s.json")
    assert AcceptanceStats.from_json(tmp_path / "s.json") == stats


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"rank_accept": [[0.7, 0.5]]}, r"rank_accept\[0\] sums to 1.2"),
        ({"rank_accept": [[0.7], [-0.1]]}, r"rank_accept\[1\]\[0\] must be in \[0, 1\]"),
        ({"rank_accept": [[0.7], ["x"]]}, r"rank_accept\[1\]\[0\] must be a number"),
        ({"rank_accept": []}, "non-empty list"),
        ({"rank_accept": [[]]}, r"rank_accept\[0\] must be a non-empty list"),
        ({"acceptance": [[0.5]]}, "need a 'rank_accept' list"),
        ([0.5], "must be a JSON object"),
    ],
)
def test_invalid_stats_name_the_problem(tmp_path: Path, payload: object, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=message):
        AcceptanceStats.from_json(path)


def test_invalid_json_text_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{rank_accept: ")
    with pytest.raises(ValueError, match="not valid JSON"):
        AcceptanceStats.from_json(path)


def test_from_counts_divides_by_depth_reached_and_drops_unreached_depths() -> None:
    snapshot = {
        "depth_rank_accepted": [[60, 20], [30, 6], [0, 0]],
        "depth_reached": [100, 60, 0],
        "num_steps": 100,
    }
    stats = AcceptanceStats.from_dict(snapshot)
    assert stats.rank_accept == ((0.6, 0.2), (0.5, 0.1))


def test_from_counts_uses_per_rank_offers_when_given() -> None:
    stats = AcceptanceStats.from_counts(
        [[60, 10]], depth_reached=[100], depth_rank_offered=[[100, 50]]
    )
    assert stats.rank_accept == ((0.6, 0.2),)


def test_from_counts_rejects_impossible_counters() -> None:
    with pytest.raises(ValueError, match="depth 0 rank 1: accepted 30 times but offered only 20"):
        AcceptanceStats.from_counts([[10, 30]], [20])
    with pytest.raises(ValueError, match="no verify step"):
        AcceptanceStats.from_counts([[0]], [0])
    with pytest.raises(ValueError, match=r"depth_reached\[0\] must be a non-negative integer"):
        AcceptanceStats.from_counts([[0]], [-1])


def test_from_position_counts_gives_conditional_chain_rates() -> None:
    stats = AcceptanceStats.from_position_counts([80, 40, 10], num_steps=100)
    assert stats.rank_accept == ((0.8,), (0.5,), (0.25,))


def test_counters_of_drafts_never_accepted_give_zero_acceptance() -> None:
    """A server whose drafts were all rejected (a snapshot of 11 steps, no rank accepted) is
    zero acceptance, not an error."""
    stats = AcceptanceStats.from_dict({"num_steps": 11, "depth_reached": [11], "depth_rank_accepted": [[]]})
    assert stats.rank_accept == ((0.0,),)
