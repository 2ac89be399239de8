"""engine/spec/verifier.py with stub targets: acceptance always / never / partial / siblings."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import make_generator
from engine.spec.tree import DraftTree
from engine.spec.verifier import AcceptResult, verify_greedy, verify_sampling

V = 8

# root 0 → 1 (tok 1) → 3 (tok 3) → 5 (tok 5)
#        → 2 (tok 2) → 4 (tok 4)
TREE = DraftTree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 3])


def _one_hot(best: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(best), V).float()  # [N, V]


# target argmax after each node of TREE; "always" follows the deepest branch 0-1-3-5
CASES = {
    "always": ([1, 3, 0, 5, 0, 7], AcceptResult([0, 1, 3, 5], 7)),
    "never": ([6, 3, 4, 5, 0, 7], AcceptResult([0], 6)),
    "partial": ([1, 6, 4, 5, 0, 7], AcceptResult([0, 1], 6)),
    "second_sibling": ([2, 3, 4, 5, 6, 7], AcceptResult([0, 2, 4], 6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy(case: str) -> None:
    best, expected = CASES[case]
    assert verify_greedy(TREE, torch.tensor(best)) == expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampling_with_deterministic_children_and_one_hot_target(case: str) -> None:
    # a one-hot target (temperature 0) makes rejection sampling agree with greedy for any seed
    best, expected = CASES[case]
    for seed in range(5):
        got = verify_sampling(TREE, _one_hot(best), make_generator(seed))
        assert got == expected


@pytest.mark.parametrize("without_replacement", [False, True])
def test_sampling_with_sampled_children_and_one_hot_target(without_replacement: bool) -> None:
    q = torch.softmax(torch.arange(V, dtype=torch.float32), dim=0)  # [V] draft law
    qs = [q, q, q, None, None, None]
    wor = [without_replacement, False, False, False, False, False]
    tree = DraftTree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 3], qs, wor)
    for seed in range(5):
        gen = make_generator(seed)
        for best, expected in CASES.values():
            assert verify_sampling(tree, _one_hot(best), gen) == expected


def test_sampling_partial_acceptance_frequency() -> None:
    # p = [0.25, 0.75, 0, ...] at the root, chain child token 1 drawn from q = [0.5, 0.5, ...]:
    # accept probability min(1, 0.75 / 0.5) = 1; child token 0: 0.25 / 0.5 = 0.5
    p = torch.zeros(2, V)
    p[:, 0], p[:, 1] = 0.25, 0.75
    q = torch.zeros(V)
    q[:2] = 0.5
    gen = make_generator(0)
    accepted = 0
    bonus_after_reject = []
    for _ in range(4000):
        res = verify_sampling(DraftTree.from_chain([5, 0], [q]), p, gen)
        accepted += res.num_accepted
        if res.num_accepted == 0:
            bonus_after_reject.append(res.bonus_token)
    assert abs(accepted / 4000 - 0.5) < 0.04
    assert set(bonus_after_reject) == {1}  # residual max(p - q, 0) = only token 1
    assert all(
        verify_sampling(DraftTree.from_chain([5, 1], [q]), p, gen).num_accepted == 1
        for _ in range(100)
    )


def test_seeded_sampling_is_reproducible() -> None:
    probs = torch.softmax(torch.randn(6, V, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [
        [verify_sampling(TREE, probs, gen) for _ in range(30)]
        for gen in (make_generator(11), make_generator(11))
    ]
    assert runs[0] == runs[1]


def test_errors() -> None:
    with pytest.raises(ValueError):
        verify_greedy(TREE, torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        verify_sampling(TREE, torch.full((3, V), 1.0 / V), make_generator(0))
    with pytest.raises(ValueError):  # a target row without mass
        verify_sampling(TREE, torch.zeros(6, V), make_generator(0))
    q = torch.zeros(V)
    q[0] = 1.0
    with pytest.raises(ValueError):  # token 3 could not have been drawn from q
        verify_sampling(DraftTree.from_chain([0, 3], [q]), _one_hot([1, 1]), make_generator(0))
