"""engine.keyed_noise: the noise a seeded request's draws race over, keyed by (seed, position).

It must be Exp(1) noise in law, independent across tokens, positions and seeds (chi-square
tests of the race's draws against their law), and a pure function of its key: the same in a
batch as alone, whatever the default generator's state."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.keyed_noise import keyed_exponentials, keyed_race, keyed_tokens

LAW = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])  # [5]
DRAWS = 20000


def _p_value(tokens: torch.Tensor, law: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=law.numel()).tolist()
    return float(chisquare(counts, (law.double() * tokens.numel()).tolist()).pvalue)


def test_the_noise_is_a_function_of_its_key_alone() -> None:
    batch = keyed_exponentials([1, 2, 2**40, 7], [0, 5, 5, 2**33], 300)  # [4, 300]
    torch.manual_seed(0)
    alone = torch.cat([keyed_exponentials([s], [p], 300) for s, p in [(1, 0), (2, 5), (2**40, 5), (7, 2**33)]])
    assert torch.equal(batch, alone)
    assert batch.shape == (4, 300) and batch.dtype == torch.float32 and bool((batch > 0).all())
    assert not torch.equal(batch[1], batch[2])  # seeds differing past their low 32 bits
    assert torch.equal(keyed_exponentials([2**64 + 3], [1], 8), keyed_exponentials([3], [1], 8))  # low 64 bits


def test_the_noise_is_exponential_in_law() -> None:
    noise = keyed_exponentials(list(range(100)), [3] * 100, 2000).double()  # [100, 2000]
    assert abs(float(noise.mean()) - 1.0) < 0.01 and abs(float(noise.var()) - 1.0) < 0.03
    # Exp(1)'s deciles: -log(1 - q).
    edges = -torch.log1p(-torch.arange(1, 10, dtype=torch.float64) / 10)
    counts = torch.bincount(torch.bucketize(noise.flatten(), edges), minlength=10).tolist()
    assert chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_the_race_draws_the_law(vary: str) -> None:
    seeds = list(range(DRAWS)) if vary == "seed" else [3] * DRAWS
    positions = [7] * DRAWS if vary == "seed" else list(range(DRAWS))
    tokens, ok = keyed_race(LAW.expand(DRAWS, 5), seeds, positions)
    assert bool(ok.all()) and _p_value(tokens, LAW) > 1e-3


def test_draws_at_neighbouring_positions_are_independent() -> None:
    tokens, _ = keyed_race(LAW.expand(DRAWS, 5), [11] * DRAWS, list(range(DRAWS)))
    pairs = tokens[:-1] * 5 + tokens[1:]  # [DRAWS - 1] over 25 cells
    assert _p_value(pairs, torch.outer(LAW, LAW).flatten()) > 1e-3
    # ... and the same position under neighbouring seeds.
    by_seed, _ = keyed_race(LAW.expand(DRAWS, 5), list(range(DRAWS)), [0] * DRAWS)
    assert _p_value(by_seed[:-1] * 5 + by_seed[1:], torch.outer(LAW, LAW).flatten()) > 1e-3


def test_the_race_needs_mass_and_well_formed_keys() -> None:
    tokens, ok = keyed_race(torch.tensor([[0.0, 0.0], [0.0, 2.0]]), [1, 1], [0, 0])
    assert ok.tolist() == [False, True] and tokens[1] == 1
    with pytest.raises(ValueError, match="no positive mass"):
        keyed_tokens(torch.zeros(1, 3), 1, [0])
    with pytest.raises(ValueError, match="non-negative"):
        keyed_exponentials([1], [-1], 4)
    with pytest.raises(ValueError, match="seeds for"):
        keyed_exponentials([1, 2], [0], 4)
    with pytest.raises(ValueError, match="one seed per row"):
        keyed_race(torch.ones(2, 3), [1], [0])


@pytest.mark.gpu
def test_the_noise_and_its_draws_are_the_same_on_cuda() -> None:
    seeds, positions = list(range(1000)), [9] * 1000
    cpu = keyed_exponentials(seeds, positions, 512)  # [1000, 512]
    cuda = keyed_exponentials(seeds, positions, 512, "cuda")
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-6, atol=0.0)
    law = torch.softmax(torch.randn(1000, 512, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert torch.equal(keyed_race(law.cuda(), seeds, positions)[0].cpu(), keyed_race(law, seeds, positions)[0])
