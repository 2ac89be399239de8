"""The device tree algebra (engine/spec/device_tree.py) against the host implementations."""

from __future__ import annotations

import pytest
import torch

from engine.spec.device_tree import accept_greedy, ancestor_mask, race_draw, select_nodes, topk_last
from engine.spec.tree import DraftTree, select_best_nodes
from engine.spec.verifier import verify_greedy


def _random_candidates(gen: torch.Generator, topk: int, depth: int, vocab: int):  # type: ignore[no-untyped-def]
    """EAGLE-2 style candidates: topk children of the root, topk children of each of the topk best
    nodes of every further depth; scores are cumulative log-probabilities (distinct)."""
    tokens, parents, scores, depths = [], [], [], []
    frontier = [(-1, 0.0)]
    for d in range(1, depth + 1):
        new = []
        for parent, score in frontier:
            toks = torch.randperm(vocab, generator=gen)[:topk].tolist()
            logp = (-torch.rand(topk, generator=gen, dtype=torch.float64) * 3).sort(descending=True).values
            for t, lp in zip(toks, logp.tolist(), strict=True):
                tokens.append(t)
                parents.append(parent)
                scores.append(score + lp)
                depths.append(d)
                new.append((len(tokens) - 1, score + lp))
        frontier = sorted(new, key=lambda x: -x[1])[:topk]
    return tokens, parents, scores, depths


@pytest.mark.parametrize("seed", range(5))
def test_selection_mask_and_acceptance_match_the_host(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    topk, depth, budget, vocab = 3, 4, 10, 7
    trees, device_inputs = [], []
    for _ in range(4):  # a batch of 4 trees
        tokens, parents, scores, depths = _random_candidates(gen, topk, depth, vocab)
        keep = select_best_nodes(torch.tensor(scores), torch.tensor(parents), budget)
        trees.append(DraftTree.from_candidates(5, tokens, parents, keep))
        device_inputs.append((tokens, parents, scores, depths))
    scores = torch.tensor([x[2] for x in device_inputs])
    cand_parents = torch.tensor([x[1] for x in device_inputs])
    sel, P = select_nodes(scores, cand_parents, budget)
    cand_tokens = torch.tensor([x[0] for x in device_inputs])
    cand_depths = torch.tensor([x[3] for x in device_inputs])
    tree_tok = torch.cat([torch.full((4, 1), 5), cand_tokens.gather(1, sel)], 1)
    depth_t = torch.cat([torch.zeros(4, 1, dtype=torch.long), cand_depths.gather(1, sel)], 1)
    mask = ancestor_mask(P, depth)
    # Targets that follow a random node's path often enough to exercise deep acceptance.
    target = torch.randint(0, vocab, (4, budget + 1), generator=gen)
    for b, tree in enumerate(trees):
        leaf = int(torch.randint(1, budget + 1, (1,), generator=gen))
        path = tree.path_to(leaf)
        for parent_node, child in zip(path, path[1:], strict=False):
            target[b, parent_node] = tree.token_list[child]
    acc = accept_greedy(tree_tok, P, depth_t, target, depth)
    for b, tree in enumerate(trees):
        assert tree_tok[b].tolist() == tree.token_list
        assert P[b, 1:].tolist() == tree.parent_list[1:]
        assert torch.equal(mask[b], tree.tree_mask())
        host = verify_greedy(tree, target[b])
        a = int(acc.num_accepted[b])
        assert acc.path[b, : a + 1].tolist() == host.accepted
        assert int(acc.bonus[b]) == host.bonus_token
        assert acc.has_child[b, : a + 1].tolist() == [bool(tree.children(n)) for n in host.accepted]
        assert acc.sibling_rank[b, 1 : a + 1].tolist() == [tree.sibling_rank(n) for n in host.accepted[1:]]


def test_ties_keep_the_selection_ancestor_closed() -> None:
    """A child as likely as its parent (draft probability 1) never displaces the parent."""
    scores = torch.tensor([[0.0, -1.0, 0.0, 0.0]])  # candidate 2 is a child of 0, 3 of 2
    parents = torch.tensor([[-1, -1, 0, 2]])
    sel, P = select_nodes(scores, parents, 3)
    assert sel.tolist() == [[0, 2, 3]]
    assert P.tolist() == [[0, 0, 1, 2]]


@pytest.mark.parametrize(("shape", "k", "chunk"), [((3, 1024), 4, 128), ((2, 4, 8192), 10, 128), ((5, 96), 3, 128)])
def test_two_stage_topk_equals_topk(shape: tuple[int, ...], k: int, chunk: int) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))  # distinct values
    values, index = topk_last(x, k, chunk)
    want_values, want_index = x.topk(k, -1)
    assert torch.equal(values, want_values) and torch.equal(index, want_index)


def test_race_draw_gives_each_group_its_temperature_law_and_draws_distinct_tokens_with_mass() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(6, 40, generator=gen)
    logits[:, 30:] = -float("inf")  # tokens of no mass are never drawn
    temperature = torch.tensor([0.5, 2.0])  # rows 0-2, rows 3-5
    torch.manual_seed(0)
    q, keys, tokens = race_draw(logits, temperature, 3, 4)
    want = torch.cat([(logits[:3] / 0.5).softmax(-1), (logits[3:] / 2.0).softmax(-1)])
    assert torch.allclose(q, want) and q.dtype == torch.float32
    assert keys.shape == tokens.shape == (6, 4) and bool((keys[:, :-1] >= keys[:, 1:]).all())
    assert bool((tokens < 30).all()) and all(len(set(row)) == 4 for row in tokens.tolist())
    law, no_keys, no_tokens = race_draw(logits, temperature, 3, 0)  # the law alone
    assert torch.equal(law, want) and no_keys.shape == no_tokens.shape == (6, 0)
    with pytest.raises(ValueError, match="6 rows do not make 2 groups of 2"):
        race_draw(logits, temperature, 2, 1)


def test_race_draw_first_draw_follows_the_law() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    torch.manual_seed(1)
    q, _, tokens = race_draw(logits, torch.ones(1), 20000, 1)
    counts = torch.bincount(tokens[:, 0], minlength=4).double() / 20000
    assert torch.allclose(counts, q[0].double(), atol=0.015)


def test_race_draw_with_top_k_and_top_p_draws_from_the_filtered_law() -> None:
    from engine.sampling import probs_from_logits

    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(4, 50, generator=gen)
    temperature, top_k, top_p = torch.tensor([0.7, 1.3]), torch.tensor([5, 0]), torch.tensor([1.0, 0.6])
    torch.manual_seed(0)
    q, keys, tokens = race_draw(logits, temperature, 2, 3, None, top_k, top_p)  # rows 0-1: top-5; 2-3: top-p
    want = probs_from_logits(logits, temperature.repeat_interleave(2), top_k.repeat_interleave(2),
                             top_p.repeat_interleave(2), filters=True)  # fmt: skip
    assert torch.allclose(q, want) and bool(((q > 0).sum(-1)[:2] == 5).all())
    drawn = keys > 0  # draws with mass are kept tokens, distinct within a row
    assert bool((q.gather(1, tokens)[drawn] > 0).all())
    assert all(len(set(row[ok].tolist())) == int(ok.sum()) for row, ok in zip(tokens, drawn, strict=True))
    with pytest.raises(ValueError, match="both top_k and top_p or with neither"):
        race_draw(logits, temperature, 2, 1, None, top_k, None)


def test_race_draw_with_a_nucleus_draws_its_law() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 1.0]]).expand(20000, 5)
    torch.manual_seed(2)
    q, _, tokens = race_draw(logits, torch.ones(1), 20000, 1, None, torch.tensor([0]), torch.tensor([0.6]))
    # masses 0.52, 0.19, 0.07, 0.03, 0.19: the top token and one of the tied pair, the lower id
    assert torch.equal(q[0] > 0, torch.tensor([True, True, False, False, False]))
    counts = torch.bincount(tokens[:, 0], minlength=5).double() / 20000
    assert torch.allclose(counts, q[0].double(), atol=0.015)
