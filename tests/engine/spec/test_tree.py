"""engine/spec/tree.py: structure, masks, positions, EAGLE-2 selection, batching."""

from __future__ import annotations

import pytest
import torch

from engine.spec.tree import DraftTree, batch_tree_masks, select_best_nodes

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
TOKENS = [10, 11, 12, 13, 14, 15, 16]
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def _brute_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    out = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            out[i][j] = True
            j = parents[j]
    return out


def test_structure() -> None:
    tree = DraftTree(TOKENS, PARENTS)
    assert tree.num_nodes == len(tree) == 7
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children(0) == [1, 2] and tree.children(1) == [3, 4] and tree.children(6) == []
    assert tree.path_to(6) == [0, 1, 3, 6] and tree.path_to(0) == [0]
    assert [tree.sibling_rank(i) for i in range(7)] == [0, 0, 1, 0, 1, 0, 0]
    assert tree.tokens.dtype == torch.int64 and tree.tokens.tolist() == TOKENS


def test_tree_mask_sees_exactly_ancestors_and_self() -> None:
    tree = DraftTree(TOKENS, PARENTS)
    mask = tree.tree_mask()  # [7, 7]
    assert mask.dtype == torch.bool
    assert mask.tolist() == _brute_mask(PARENTS)
    chain = DraftTree.from_chain([5, 6, 7, 8])
    assert torch.equal(chain.tree_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_positions_are_context_plus_depth() -> None:
    tree = DraftTree(TOKENS, PARENTS)
    assert tree.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103]


@pytest.mark.parametrize(
    ("tokens", "parents"),
    [
        ([1, 2], [0, 0]),  # root must have parent -1
        ([1, 2, 3], [-1, 2, 0]),  # parent after child
        ([1, 2, 3], [-1, 0, 2]),  # own parent
        ([1, 2, 3], [-1, 0]),  # length mismatch
        ([], []),
        ([1, -2], [-1, 0]),
    ],
)
def test_broken_trees_raise(tokens: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_without_replacement_metadata_is_validated() -> None:
    q = torch.full((20,), 0.05)
    with pytest.raises(ValueError):  # repeated tokens cannot come from a draw without replacement
        DraftTree([1, 3, 3], [-1, 0, 0], [q, None, None], [True, False, False])
    with pytest.raises(ValueError):  # without replacement needs q
        DraftTree([1, 3, 4], [-1, 0, 0], None, [True, False, False])
    with pytest.raises(ValueError):
        DraftTree([1, 3], [-1, 0], [torch.ones(2, 2), None])
    DraftTree([1, 3, 3], [-1, 0, 0], [q, None, None])  # i.i.d. draws may repeat


def test_from_chain_records_each_q_at_the_parent() -> None:
    q1, q2 = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    chain = DraftTree.from_chain([0, 1, 0], child_q=[q1, q2])
    assert chain.parents.tolist() == [-1, 0, 1]
    assert chain.child_q[0] is q1 and chain.child_q[1] is q2 and chain.child_q[2] is None


def test_select_best_nodes_budget_and_ancestor_closure() -> None:
    # candidates: two top-2 levels; cumulative log-probs
    parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    cum = torch.tensor([-0.1, -1.0, -0.3, -2.5, -1.2, -1.5])
    assert select_best_nodes(cum, parents, 3).tolist() == [0, 1, 2]
    assert select_best_nodes(cum, parents, 4).tolist() == [0, 1, 2, 4]
    assert select_best_nodes(cum, parents, 0).tolist() == []
    assert select_best_nodes(cum, parents, 99).tolist() == list(range(6))


def test_select_best_nodes_never_keeps_a_child_without_its_parent() -> None:
    # non-monotone scores (child better than parent) and ties: the parent still comes first
    parents = torch.tensor([-1, 0, -1, 2])
    cum = torch.tensor([-3.0, -0.1, -1.0, -1.0])
    assert select_best_nodes(cum, parents, 1).tolist() == [2]
    assert select_best_nodes(cum, parents, 2).tolist() == [2, 3]
    assert select_best_nodes(cum, parents, 3).tolist() == [0, 2, 3]  # 1 is capped at -3
    # random candidate trees: every selection is ancestor-closed and of the budget's size
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        m = 30
        par = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, m)]
        scores = torch.randn(m, generator=gen)
        for budget in (1, 5, 17):
            kept = set(select_best_nodes(scores, torch.tensor(par), budget).tolist())
            assert len(kept) == budget
            assert all(par[i] == -1 or par[i] in kept for i in kept)


def test_select_best_nodes_rejects_bad_parents() -> None:
    with pytest.raises(ValueError):
        select_best_nodes(torch.zeros(2), torch.tensor([-1, 1]), 1)


def test_from_candidates_reindexes_parent_before_child() -> None:
    cand_tokens = [20, 21, 22, 23, 24, 25]
    cand_parents = [-1, -1, 0, 0, 1, 1]
    tree = DraftTree.from_candidates(7, cand_tokens, cand_parents, [0, 1, 2, 4])
    assert tree.tokens.tolist() == [7, 20, 21, 22, 24]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]
    assert tree.child_q == [None] * 5
    with pytest.raises(ValueError):
        DraftTree.from_candidates(7, cand_tokens, cand_parents, [0, 4])  # 4 without 1


def test_batch_tree_masks_format() -> None:
    trees = [DraftTree(TOKENS, PARENTS), DraftTree([3], [-1]), DraftTree.from_chain([1, 2, 3])]
    new_mask, query_start = batch_tree_masks(trees)
    assert new_mask.shape == (11, 7) and new_mask.dtype == torch.bool
    assert query_start.dtype == torch.int32 and query_start.tolist() == [0, 7, 8, 11]
    assert torch.equal(new_mask[:7], trees[0].tree_mask())
    assert new_mask[7].tolist() == [True] + [False] * 6
    assert new_mask[8:].tolist() == [
        [True, False, False] + [False] * 4,
        [True, True, False] + [False] * 4,
        [True, True, True] + [False] * 4,
    ]


def test_path_token_counts_add_drafted_ancestors() -> None:
    tree = DraftTree([0, 1, 2, 1], [-1, 0, 0, 1])
    base = torch.tensor([1, 0, 0, 5], dtype=torch.int32)  # committed tokens incl. the root
    counts = tree.path_token_counts(base)  # [4, 4]
    assert counts.tolist() == [[1, 0, 0, 5], [1, 1, 0, 5], [1, 0, 1, 5], [1, 2, 0, 5]]
