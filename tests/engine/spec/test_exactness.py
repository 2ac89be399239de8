"""Tree speculation reproduces the target: token-identical (greedy), same joint law (sampling).

A synthetic target and a different synthetic draft give next-token laws over a tiny vocabulary as
a function of the whole prefix. We run the full speculative loop (draft a tree, verify, append
accepted tokens and the bonus) until 3 tokens exist, many times, and compare the empirical joint
law of those 3 tokens with the exact target joint (enumerated) by a chi-square test. The same
test must clearly fail for deliberately broken acceptance rules, so it has the power to notice.
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from engine.sampling import (
    make_generator,
    probs_from_logits,
    sample_from_probs,
    sample_without_replacement,
)
from engine.spec import verifier
from engine.spec.tree import DraftTree

V = 4
START = 0  # the pending token before the first generated one
NUM_TOKENS = 3
RUNS = 4_000  # per law test; the broken rules fail by a wide margin with BROKEN_RUNS
BROKEN_RUNS = 2_000

# A tree shape: (mode, k, shapes of the first children); modes:
#   "iid" k i.i.d. draws from q, "wor" k draws without replacement, "topk" deterministic top-k;
#   known bugs: "topk_as_sampled" top-k recorded as i.i.d. draws from the softmax q,
#   "wor_as_iid" draws without replacement recorded as i.i.d. (q never updated).
Shape = tuple[str, int, list["Shape"]]

SHAPES: dict[str, Shape] = {
    "chain": ("iid", 1, [("iid", 1, [("iid", 1, [])])]),
    "two_iid_siblings": ("iid", 2, [("iid", 1, []), ("iid", 1, [])]),
    "three_wor_siblings": ("wor", 3, [("wor", 2, []), ("wor", 1, [])]),
    "topk_deterministic": ("topk", 2, [("topk", 2, []), ("topk", 1, [])]),
    "mixed": ("topk", 2, [("iid", 2, []), ("wor", 2, [("topk", 1, [])])]),
}


def _seed(prefix: tuple[int, ...], salt: int) -> int:
    code = 1
    for t in prefix:
        code = code * (V + 1) + t + 1
    return code * 7919 + salt


@functools.cache
def target_law(prefix: tuple[int, ...]) -> torch.Tensor:
    """[V] float32; temperature 0.8 and top-k 3, so one token per prefix has probability 0."""
    gen = torch.Generator().manual_seed(_seed(prefix, 1))
    logits = 1.5 * torch.randn(1, V, generator=gen)  # [1, V]
    one = torch.ones(1)
    return probs_from_logits(logits, 0.8 * one, torch.tensor([3]), one)[0]


@functools.cache
def draft_law(prefix: tuple[int, ...]) -> torch.Tensor:
    """[V] float32, full support, unrelated to the target."""
    gen = torch.Generator().manual_seed(_seed(prefix, 2))
    return torch.softmax(1.5 * torch.randn(V, generator=gen), dim=0)


def exact_joint() -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=NUM_TOKENS):
        prob = 1.0
        for i, tok in enumerate(seq):
            law = target_law((START, *seq[:i])).double()
            prob *= float(law[tok] / law.sum())
        joint[seq] = prob
    return joint


@functools.cache
def draft_law_list(prefix: tuple[int, ...]) -> tuple[list[float], list[int]]:
    """``draft_law`` as Python floats and its tokens by decreasing probability (fast drafting)."""
    q = draft_law(prefix).tolist()
    return q, sorted(range(V), key=lambda t: -q[t])


def draft_tree(
    ctx: tuple[int, ...], shape: Shape, gen: torch.Generator, rng: random.Random
) -> tuple[DraftTree, list[tuple[int, ...]]]:
    """Draft a tree rooted at the pending token ``ctx[-1]``; also return each node's prefix.

    The draft's randomness (``rng``, and ``gen`` for without-replacement draws) is independent
    of the verifier's coins, as in the engine.
    """
    tokens, parents, wor, prefixes = [ctx[-1]], [-1], [False], [ctx]
    qs: list[torch.Tensor | None] = [None]

    def expand(node: int, spec: Shape) -> None:
        mode, k, sub_shapes = spec
        q = draft_law(prefixes[node])  # [V]
        q_list, ranked = draft_law_list(prefixes[node])
        if mode == "iid":
            drawn = rng.choices(range(V), weights=q_list, k=k)
        elif mode in ("wor", "wor_as_iid"):
            drawn = sample_without_replacement(q, k, gen)
        else:
            drawn = ranked[:k]
        if mode != "topk":
            qs[node] = q
        wor[node] = mode == "wor"
        kids = []
        for tok in drawn:
            kids.append(len(tokens))
            tokens.append(tok)
            parents.append(node)
            qs.append(None)
            wor.append(False)
            prefixes.append((*prefixes[node], tok))
        for kid, sub in zip(kids, sub_shapes, strict=False):
            expand(kid, sub)

    expand(0, shape)
    return DraftTree(tokens, parents, qs, wor), prefixes


def speculate(shape: Shape, gen: torch.Generator, rng: random.Random) -> tuple[int, ...]:
    """Generate NUM_TOKENS tokens by tree speculation with exact rejection sampling."""
    ctx: tuple[int, ...] = (START,)
    while len(ctx) <= NUM_TOKENS:
        tree, prefixes = draft_tree(ctx, shape, gen, rng)
        probs = torch.stack([target_law(p) for p in prefixes])  # [N, V]
        res = verifier.verify_sampling(tree, probs, gen)
        ctx = (*ctx, *(tree.token_list[i] for i in res.accepted[1:]), res.bonus_token)
    return ctx[1 : NUM_TOKENS + 1]


def chi_square_pvalue(draw: Callable[[], tuple[int, ...]], runs: int) -> float:
    exact = exact_joint()
    counts = collections.Counter(draw() for _ in range(runs))
    assert all(counts[seq] == 0 for seq, pr in exact.items() if pr == 0.0)
    obs, exp = [], []
    pooled_obs, pooled_exp = 0, 0.0  # cells expected below 5 are pooled
    for seq, pr in exact.items():
        if pr == 0.0:
            continue
        if runs * pr < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[seq], pooled_exp + runs * pr
        else:
            obs.append(counts[seq])
            exp.append(runs * pr)
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    total = sum(exp)
    return float(chisquare(obs, [e * runs / total for e in exp]).pvalue)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_sampled_tree_speculation_has_the_target_joint_law(name: str) -> None:
    gen, rng = make_generator(1234), random.Random(4321)
    assert chi_square_pvalue(lambda: speculate(SHAPES[name], gen, rng), RUNS) > 1e-3


def test_reference_sampler_passes_the_same_test() -> None:
    """Plain autoregressive sampling from the target: the test's calibration."""
    gen = make_generator(99)

    def autoregressive() -> tuple[int, ...]:
        ctx: tuple[int, ...] = (START,)
        for _ in range(NUM_TOKENS):
            ctx = (*ctx, sample_from_probs(target_law(ctx), gen))
        return ctx[1:]

    assert chi_square_pvalue(autoregressive, RUNS) > 1e-3


def test_residual_without_subtracting_q_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifier, "_residual", lambda p, q: p.clone())
    gen, rng = make_generator(5), random.Random(5)
    assert chi_square_pvalue(lambda: speculate(SHAPES["chain"], gen, rng), BROKEN_RUNS) < 1e-6


@pytest.mark.parametrize(
    "broken",
    [
        ("topk_as_sampled", 2, [("topk_as_sampled", 2, []), ("topk_as_sampled", 1, [])]),
        ("wor_as_iid", 3, [("wor_as_iid", 2, []), ("wor_as_iid", 1, [])]),
    ],
    ids=["softmax_q_for_top_k_children", "without_replacement_treated_as_iid"],
)
def test_wrong_draft_bookkeeping_is_detected(broken: Shape) -> None:
    gen, rng = make_generator(6), random.Random(6)
    assert chi_square_pvalue(lambda: speculate(broken, gen, rng), BROKEN_RUNS) < 1e-6


def test_greedy_tree_speculation_equals_argmax_decoding() -> None:
    def argmax_law(prefix: tuple[int, ...]) -> int:
        return int(target_law(prefix).argmax())

    for start in range(V):
        reference: tuple[int, ...] = (start,)
        while len(reference) <= 12:
            reference = (*reference, argmax_law(reference))
        ctx: tuple[int, ...] = (start,)
        steps = 0
        while len(ctx) <= 12:
            tree, prefixes = draft_tree(
                ctx, SHAPES["topk_deterministic"], make_generator(0), random.Random(0)
            )
            best = torch.tensor([argmax_law(p) for p in prefixes])  # [N]
            res = verifier.verify_greedy(tree, best)
            ctx = (*ctx, *(tree.token_list[i] for i in res.accepted[1:]), res.bonus_token)
            steps += 1
        assert ctx[:13] == reference
