"""Benchmark mode specs: tree budgets as draft-token counts or explicit shapes."""

from __future__ import annotations

import pytest

from bench.modes import build_modes


def test_tree_budgets_and_shapes() -> None:
    modes = build_modes(["tree", "chain"], [0, 32, "4x8-40"])
    assert [m.label for m in modes] == ["ar", "tree", "tree-32", "tree-4x8-40", "chain"]
    shaped = modes[3].spec
    assert shaped is not None and (shaped.topk, shaped.depth, shaped.num_draft_tokens) == (4, 8, 40)
    assert modes[2].spec is not None and modes[2].spec.num_draft_tokens == 32
    assert modes[2].spec.topk is None  # the device default shape


@pytest.mark.parametrize("bad", ["4x8", "x-3", "wide"])
def test_malformed_tree_shape_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="TOPKxDEPTH-N"):
        build_modes(["tree"], [bad])


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown modes"):
        build_modes(["tree", "medusa"], [])



def test_adaptive_tree_arm_takes_an_explicit_shape() -> None:
    default, shaped = (build_modes(["adaptive"], [], tree)[1].spec for tree in (None, "4x4-32"))
    assert default is not None and default.method == "adaptive" and default.depth is None
    assert shaped is not None and shaped.method == "adaptive"
    assert (shaped.topk, shaped.depth, shaped.num_draft_tokens) == (4, 4, 32)
    with pytest.raises(ValueError, match="TOPKxDEPTH-N"):
        build_modes(["adaptive"], [], "4x4")


def test_adaptive_chain_arms_are_passed_on() -> None:
    default, chains = (build_modes(["adaptive"], [], None, c)[1].spec for c in (None, [4, 6]))
    assert default is not None and default.chain_depths is None
    assert chains is not None and chains.method == "adaptive" and chains.chain_depths == (4, 6)
