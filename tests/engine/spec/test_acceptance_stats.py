"""Batch acceptance counting (``AcceptanceCounter.record_paths``) against the per-path count."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec.acceptance_stats import VECTORISED_MIN_PATHS, AcceptanceCounter


def _random_paths(
    rng: np.random.Generator, n: int, depth: int, width: int
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Packed outputs as the graphed step writes them: columns past a path's end hold junk."""
    accepted = rng.integers(0, depth + 1, size=n)
    has_child = rng.integers(0, 2, size=(n, depth + 1))
    ranks = rng.integers(0, width, size=(n, depth + 1))
    for i, a in enumerate(accepted):
        has_child[i, :a] = 1  # a node whose child was accepted had children
    return accepted.tolist(), has_child, ranks


def _per_path(
    accepted: list[int], has_child: np.ndarray, ranks: np.ndarray, width: int | None
) -> dict[str, object]:
    counter = AcceptanceCounter()
    for a, has, rank in zip(accepted, has_child.tolist(), ranks.tolist(), strict=True):
        counter.record_path([bool(h) for h in has[: a + 1]], rank[1 : a + 1], None if width is None else [width] * (a + 1))
    return counter.snapshot()


@pytest.mark.parametrize("width", [None, 4])
@pytest.mark.parametrize("n", [1, VECTORISED_MIN_PATHS - 1, VECTORISED_MIN_PATHS, 64, 257])
def test_batch_counts_equal_per_path_counts(n: int, width: int | None) -> None:
    rng = np.random.default_rng(n)
    counter = AcceptanceCounter()
    expected_steps = []
    for _ in range(5):  # several steps accumulate, lists grow as deeper depths are reached
        accepted, has_child, ranks = _random_paths(rng, n, depth=6, width=4)
        counter.record_paths(accepted, has_child, ranks, width)
        expected_steps.append((accepted, has_child, ranks))
    all_accepted = [a for acc, _, _ in expected_steps for a in acc]
    all_has = np.concatenate([h for _, h, _ in expected_steps])
    all_ranks = np.concatenate([r for _, _, r in expected_steps])
    snapshot = counter.snapshot()
    assert snapshot == _per_path(all_accepted, all_has, all_ranks, width)
    assert ("depth_rank_offered" in snapshot) == (width is not None)


def test_offered_counts_are_each_ranks_denominator() -> None:
    """A chain step offers rank 0 only, a top-3 step ranks 0 to 2: each rank's rate is over the
    nodes that offered it. Accepted rows are padded to the offered ranks; a step that did not say
    how many children its nodes had drops the offered counts from the snapshot."""
    from engine.simulator import AcceptanceStats

    counter = AcceptanceCounter()
    counter.record_path([True, True], [1], [3, 3])  # top-3 tree: rank 1 at depth 1, then rejected
    counter.record_path([True], [], [3])  # top-3 tree: rejected at depth 1
    counter.record_path([True, False], [0], [1, 1])  # chain: rank 0 at depth 1, a leaf
    counter.record_path([True], [], [1])  # chain: rejected at depth 1
    snapshot = counter.snapshot()
    assert snapshot == {
        "num_steps": 4,
        "depth_reached": [4, 1],
        "depth_rank_accepted": [[1, 1, 0], [0, 0, 0]],
        "depth_rank_offered": [[4, 2, 2], [1, 1, 1]],
    }
    assert AcceptanceStats.from_dict(snapshot).rank_accept[0] == pytest.approx((1 / 4, 1 / 2, 0.0))
    counter.record_path([True], [])
    assert "depth_rank_offered" not in counter.snapshot()


def test_batch_counts_leave_unreached_depths_out() -> None:
    """Lists end at the deepest depth offered and the highest rank accepted, as per path."""
    n = VECTORISED_MIN_PATHS
    accepted = [1] * n
    has_child = np.zeros((n, 7), dtype=np.int64)
    has_child[:, :1] = 1  # only the root had children; the accepted depth-1 node had none
    ranks = np.full((n, 7), 3)
    ranks[:, 1] = 0
    counter = AcceptanceCounter()
    counter.record_paths(accepted, has_child, ranks)
    assert counter.snapshot() == {
        "num_steps": n,
        "depth_reached": [n],
        "depth_rank_accepted": [[n]],
    }


def test_a_tree_steps_results_tell_what_the_chain_would_have_yielded() -> None:
    """The chain drafts each depth's best child of the previous best child: on a tree step its
    accepted drafts are the accepted path's leading rank-0 nodes (at most its depth)."""
    import numpy as np

    from engine.spec.graphed_state import StepResults

    ranks = np.array([
        [0, 0, 0, 0, 0, 0, 0],  # 5 accepted through rank 0
        [0, 0, 1, 0, 0, 0, 0],  # rank 1 at depth 2: the chain stops after depth 1
        [0, 2, 0, 0, 0, 0, 0],  # rank 2 at depth 1: the chain accepts nothing
        [0, 0, 0, 0, 0, 0, 0],  # nothing accepted (ranks past a are not read)
    ])  # fmt: skip
    results = StepResults([[1]] * 4, [5, 3, 2, 0], np.ones_like(ranks, dtype=bool), ranks)
    assert results.chain_tokens(4) == (4 + 1) + (1 + 1) + (0 + 1) + (0 + 1)
    assert results.chain_tokens(6) == (5 + 1) + 2 + 1 + 1
    assert results.chain_tokens(1) == 2 + 2 + 1 + 1


def test_chain_tokens_counts_alike_for_small_and_large_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small batches are counted in Python, large ones with numpy: the same counts."""
    import numpy as np

    from engine.spec import graphed_state
    from engine.spec.graphed_state import StepResults

    rng = np.random.default_rng(0)
    for n in (1, 5, 40):
        ranks = rng.integers(0, 3, (n, 7)) * (rng.random((n, 7)) < 0.4)
        accepted = rng.integers(0, 7, n).tolist()
        results = StepResults([[1]] * n, accepted, np.ones_like(ranks, dtype=bool), ranks)
        counts = []
        for small in (0, 64):  # numpy for every batch, then Python for every batch
            monkeypatch.setattr(graphed_state, "SMALL_BATCH", small)
            counts.append([results.chain_tokens(d) for d in (1, 4, 6)])
        assert counts[0] == counts[1]
