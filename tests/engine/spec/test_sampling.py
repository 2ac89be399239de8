"""engine/sampling.py: penalties, temperature/top-k/top-p, seeded draws."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare

from engine.params import SamplingParams
from engine.sampling import (
    SamplingTensors,
    apply_penalties,
    make_generator,
    probs_from_logits,
    sample_from_probs,
    sample_without_replacement,
    temperature_softmax,
    token_counts,
)


def _probs(
    logits: list[list[float]], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    x = torch.tensor(logits)  # [N, V]
    n = x.shape[0]
    return probs_from_logits(
        x, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p)
    )


def test_plain_softmax_with_temperature() -> None:
    logits = [[1.0, 2.0, 3.0, 0.5]]
    got = _probs(logits, temperature=0.5)
    torch.testing.assert_close(got, torch.softmax(torch.tensor(logits) / 0.5, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_softmax_equals_the_general_path_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 300, generator=gen) * 4).to(dtype)  # [N, V]
    temps = [0.7, 1.0, 1e-3, 2.5, 0.3]
    want = probs_from_logits(logits, torch.tensor(temps), torch.zeros(5, dtype=torch.long),
                             torch.ones(5))  # fmt: skip
    got = temperature_softmax(logits, torch.tensor(temps))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    unfiltered = probs_from_logits(logits, torch.tensor(temps), torch.zeros(5, dtype=torch.long),
                                   torch.ones(5), filters=False)  # the graphed sampled step's call
    assert torch.equal(unfiltered, want)


def test_greedy_rows_are_one_hot_lowest_index_on_ties() -> None:
    got = _probs([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]], temperature=0.0, top_k=1)
    assert got.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_mixed_rows_are_independent() -> None:
    x = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])  # [2, 3]
    got = probs_from_logits(
        x, torch.tensor([0.0, 1.0]), torch.tensor([0, 2]), torch.tensor([1.0, 1.0])
    )
    assert got[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(got[1], torch.softmax(torch.tensor([1.0, 2.0, -1e9]), dim=-1))


def test_top_k_keeps_exactly_k_lower_ids_on_ties() -> None:
    got = _probs([[1.0, 2.0, 2.0, 2.0, 0.0]], top_k=2)[0]
    assert (got > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))
    # k larger than the vocabulary means off
    torch.testing.assert_close(_probs([[1.0, 2.0]], top_k=10), _probs([[1.0, 2.0]]))


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = p.log().tolist()
    assert (_probs(logits, top_p=0.8)[0] > 0).tolist() == [True, True, False, False]
    assert (_probs(logits, top_p=0.81)[0] > 0).tolist() == [True, True, True, False]
    # the top token is kept even when it alone exceeds top_p
    assert (_probs(logits, top_p=0.1)[0] > 0).tolist() == [True, False, False, False]
    torch.testing.assert_close(_probs(logits, top_p=0.81)[0, :3], p[0, :3] / 0.95)


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    # after top-2: [4/7, 3/7]; top_p = 0.5 then keeps only the first
    assert (_probs([logits], top_k=2, top_p=0.5)[0] > 0).tolist() == [True, False, False, False]
    # without top-k, 0.4 < 0.5 so two tokens are kept
    assert (_probs([logits], top_p=0.5)[0] > 0).tolist() == [True, True, False, False]


def test_penalties_follow_openai_formula() -> None:
    logits = torch.zeros(2, 4)  # [2, 4]
    counts = token_counts([[1, 1, 3], []], vocab_size=4)  # [2, 4]
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0]]
    got = apply_penalties(
        logits, counts, presence=torch.tensor([0.5, 0.5]), frequency=torch.tensor([0.25, 0.25])
    )
    assert got.tolist() == [[0.0, -1.0, 0.0, -0.75], [0.0, 0.0, 0.0, 0.0]]
    assert logits.abs().sum() == 0  # input untouched


def test_sampling_tensors_from_params() -> None:
    t = SamplingTensors.from_params(
        [SamplingParams(temperature=0.0, top_k=3), SamplingParams(top_p=0.5, presence_penalty=1.0)]
    )
    assert t.temperature.tolist() == [0.0, 1.0]
    assert t.top_k.tolist() == [3, 0]
    assert t.top_p.tolist() == [1.0, 0.5]
    assert t.presence.tolist() == [0.0, 1.0]
    assert t.frequency.tolist() == [0.0, 0.0]
    assert [x.dtype for x in (t.temperature, t.top_k, t.top_p, t.presence, t.frequency)] == [
        torch.float32, torch.int64, torch.float32, torch.float32, torch.float32
    ]
    odd = SamplingTensors.from_params([SamplingParams(temperature=0.7, top_k=50_000, top_p=0.9)])
    assert odd.temperature.item() == torch.tensor(0.7).item() and odd.top_k.item() == 50_000
    assert odd.top_p.item() == torch.tensor(0.9).item()
    assert SamplingTensors.from_params([]).top_k.shape == (0,)


def test_seeded_draws_are_reproducible_and_independent_of_other_rows() -> None:
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    a = [sample_from_probs(p, make_generator(7)) for _ in range(3)]
    g1, g2 = make_generator(7), make_generator(7)
    seq1 = [sample_from_probs(p, g1) for _ in range(50)]
    seq2 = []
    other = make_generator(8)
    for _ in range(50):
        sample_from_probs(p, other)  # another sequence's draws do not disturb this one
        seq2.append(sample_from_probs(p, g2))
    assert seq1 == seq2
    assert len(set(a)) == 1
    # unseeded generators differ
    seqs = {tuple(sample_from_probs(p, make_generator(None)) for _ in range(30)) for _ in range(3)}
    assert len(seqs) > 1


def test_sample_from_probs_matches_distribution_and_skips_zero_mass() -> None:
    p = torch.tensor([0.1, 0.0, 0.5, 0.4, 0.0])
    g = make_generator(0)
    counts = collections.Counter(sample_from_probs(p * 3.0, g) for _ in range(20000))
    assert counts[1] == 0 and counts[4] == 0
    obs = [counts[i] for i in (0, 2, 3)]
    assert chisquare(obs, [2000, 10000, 8000]).pvalue > 1e-3
    with pytest.raises(ValueError):
        sample_from_probs(torch.zeros(3), g)


def test_without_replacement_never_repeats_and_stops_at_support() -> None:
    g = make_generator(1)
    p = torch.tensor([0.0, 0.2, 0.3, 0.0, 0.5])
    for _ in range(200):
        drawn = sample_without_replacement(p, 4, g)
        assert len(drawn) == 3 and len(set(drawn)) == 3 and set(drawn) == {1, 2, 4}
    assert sample_without_replacement(p, 0, g) == []


def test_without_replacement_second_draw_law() -> None:
    # P(second = j | first = i) = p_j / (1 - p_i)
    p = torch.tensor([0.5, 0.3, 0.2])
    g = make_generator(2)
    pairs = collections.Counter(tuple(sample_without_replacement(p, 2, g)) for _ in range(20000))
    keys = [(i, j) for i in range(3) for j in range(3) if i != j]
    pl = [0.5, 0.3, 0.2]
    expected = [pl[i] * pl[j] / (1 - pl[i]) for i, j in keys]
    expected = [20000 * e / sum(expected) for e in expected]  # exact total for chisquare
    assert chisquare([pairs[k] for k in keys], expected).pvalue > 1e-3


def test_batched_rows_draw_what_single_rows_draw() -> None:
    """``draw_rows`` keys each seeded row's noise by (seed, position): a seeded request draws
    the same tokens alone or in a batch, beside unseeded rows or not."""
    from engine.sampling import draw_rows

    probs = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    for position in range(20):
        keys = [(100 + r, position) for r in range(5)]
        single = [int(draw_rows(probs[r : r + 1], [keys[r]])[0]) for r in range(5)]
        assert draw_rows(probs, keys)[0].tolist() == single
        mixed = draw_rows(probs, [keys[0], None, keys[2], None, keys[4]])[0].tolist()
        assert mixed[0::2] == single[0::2]


def test_batched_rows_reject_rows_without_mass() -> None:
    """``draw_rows`` flags a row without mass; reading the draw (``read_drawn``) refuses it."""
    from engine.sampling import draw_rows
    from engine.token_draw import read_drawn

    probs = torch.zeros(2, 4)
    probs[0, 1] = 1.0
    tokens, ok = draw_rows(probs, [(0, 3), None])
    assert ok.tolist() == [True, False]
    assert read_drawn(tokens, ok, [0]) == [1]
    with pytest.raises(ValueError, match="no positive mass"):
        read_drawn(tokens, ok)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_staged_read_of_drawn_tokens_gives_them_and_refuses_rows_without_mass(device: str) -> None:
    """``stage_drawn`` / ``read_staged`` (the prefill's early catch-up reads its first tokens
    so): the same tokens as ``read_drawn``, greedy rows and sampled ones alike."""
    from engine.token_draw import read_drawn, read_staged, stage_drawn

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    tokens = torch.tensor([3, 1, 4], device=device)
    assert read_staged(*stage_drawn(tokens, None)) == read_drawn(tokens, None) == [3, 1, 4]
    ok = torch.tensor([True, True, True], device=device)
    assert read_staged(*stage_drawn(tokens, ok)) == [3, 1, 4]
    with pytest.raises(ValueError, match="no positive mass"):
        read_staged(*stage_drawn(tokens, torch.tensor([True, False, True], device=device)))


def test_seeded_rows_next_to_unseeded_ones_draw_what_they_draw_alone() -> None:
    """Unseeded rows share one draw from the default generator; the seeded rows among them
    race their keyed noise (``engine.keyed_noise``) and draw as they would alone."""
    from engine.keyed_noise import keyed_race
    from engine.sampling import draw_rows

    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    for position in range(20):
        want = keyed_race(probs[0::2], [7, 8], [position, position])[0].tolist()
        torch.manual_seed(3)
        got = draw_rows(probs, [(7, position), None, (8, position), None])[0].tolist()
        torch.manual_seed(3)
        again = draw_rows(probs, [None] * 4)[0].tolist()
        assert [got[0], got[2]] == want
        assert [got[1], got[3]] == [again[1], again[3]], "the unseeded rows' shared draw"
