"""Stub-law unit tests of the device-side sampled acceptance (``device_tree.accept_sampled``)."""

from __future__ import annotations

import torch

from engine.simulator.tree_shape import TreeShape
from engine.spec.device_tree import StaticTree, accept_sampled

V = 6
# root -> 1 (rank 0), 2 (rank 1); 1 -> 3; 3 -> 4: internal nodes 0, 1, 3 (draft-law rows 0, 1, 2)
SHAPE = TreeShape(parents=(-1, 0, 0, 1, 3), ranks=(0, 0, 1, 0, 0))
TOKENS = [0, 1, 2, 3, 4]


def _one_hot(t: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(t), V).float()


def _run(p_rows: list[torch.Tensor], q_rows: list[torch.Tensor], batch: int = 1):  # type: ignore[no-untyped-def]
    tree = StaticTree.build(SHAPE, [0, 1, 3], torch.device("cpu"))
    tokens = torch.tensor([TOKENS] * batch)
    valid = torch.ones(batch, 5, dtype=torch.bool)
    p_all = torch.stack(p_rows)[None].expand(batch, -1, -1)
    q_all = torch.stack(q_rows)[None].expand(batch, -1, -1)
    return accept_sampled(tokens, valid, p_all, q_all, tree)


def test_target_equal_to_point_drafts_accepts_the_whole_first_branch() -> None:
    # Draft and target agree on a point mass at each node's first child: always accepted.
    p = [_one_hot(1), _one_hot(3), _one_hot(5), _one_hot(4), _one_hot(5)]
    q = [_one_hot(1), _one_hot(3), _one_hot(4)]
    out = _run(p, q)
    assert out.num_accepted.item() == 3
    assert out.path[0].tolist() == [0, 1, 3, 4]
    assert out.bonus.item() == 5  # from the target at the leaf
    assert out.has_child[0].tolist() == [True, True, True, False]


def test_drafts_the_target_never_emits_are_all_rejected() -> None:
    # The target puts no mass on tokens 1 and 2: both root children rejected, the bonus is
    # drawn from the residual, which is the target itself (all mass on token 0).
    p = [_one_hot(0), _one_hot(3), _one_hot(5), _one_hot(4), _one_hot(5)]
    q = [torch.full((V,), 1 / V), _one_hot(3), _one_hot(4)]
    out = _run(p, q, batch=64)
    assert (out.num_accepted == 0).all()
    assert (out.bonus == 0).all()
    assert (out.path == 0).all()


def test_second_sibling_is_tried_after_the_first_is_rejected() -> None:
    # Target: token 2 only. Draft law of the root: uniform over {1, 2}; the first draw (token 1)
    # is always rejected, the second (token 2) always accepted, with q renormalised without 1.
    p = [_one_hot(2), _one_hot(3), _one_hot(5), _one_hot(4), _one_hot(5)]
    q = [(_one_hot(1) + _one_hot(2)) / 2, _one_hot(3), _one_hot(4)]
    out = _run(p, q, batch=64)
    assert (out.num_accepted == 1).all()
    assert (out.path[:, 1] == 2).all()
    assert (out.sibling_rank[:, 1] == 1).all()
    assert (out.bonus == 5).all()  # node 2 is a leaf: the target's law after it


def test_partial_acceptance_rate_is_min_one_p_over_q() -> None:
    # Root: q(1) = 1 (point), p(1) = 0.3 -> accept 30% of the time.
    torch.manual_seed(0)
    p0 = torch.zeros(V)
    p0[1], p0[5] = 0.3, 0.7
    p = [p0, _one_hot(3), _one_hot(5), _one_hot(4), _one_hot(5)]
    q = [_one_hot(1), _one_hot(3), _one_hot(4)]
    out = _run(p, q, batch=20_000)
    rate = (out.path[:, 1] == 1).float().mean().item()
    assert abs(rate - 0.3) < 0.02
    rejected = out.num_accepted[:, 0] == 0
    # After the rejection q without token 1 has no mass, so the second child (token 2) has
    # q = 0 and is rejected; the bonus comes from the residual max(p - q, 0) = token 5.
    assert (out.bonus[rejected] == 5).all()
