"""The default greedy trees are the optimiser's choice on the measured inputs shipped with them."""

from __future__ import annotations

import json
import shlex

import pytest

from engine.params import SpecConfig
from engine.simulator import AcceptanceStats, LatencyModel, best_budget, estimate, optimal_tree
from engine.simulator.cli import main
from engine.simulator.tree_shape import TreeShape
from engine.spec.defaults import (
    CHAIN_DEPTH,
    CPU_TREE,
    DEFAULT_INPUTS,
    DERIVATIONS,
    GPU_TREE,
    budget_from_plan,
    chain_budgets,
    derive_default_budget,
)
from engine.spec.drafter import TreeBudget


def test_cpu_default_is_the_optimisers_choice_on_the_shipped_inputs() -> None:
    assert DERIVATIONS["cpu"].derive() == CPU_TREE


def test_gpu_default_is_the_optimisers_choice_on_the_h200_inputs() -> None:
    assert DERIVATIONS["cuda"].derive() == GPU_TREE


def test_gpu_chain_arm_is_one_depth_short_of_the_optimisers_best_chain_and_nearly_as_fast() -> None:
    """Adaptive speculation's chain arm on the graphed path (``CHAIN_DEPTH``) serves large
    batches, where a drafted depth costs more than at batch 1: it is one depth shorter than the
    chain the optimiser picks at batch 1, and within 2% of its predicted speed there."""
    d = DERIVATIONS["cuda"]
    stats, latency = d.inputs()
    best = derive_default_budget(stats, latency, 1, d.max_budget, d.max_depth, max_width=1)
    assert (best.topk, best.depth) == (1, CHAIN_DEPTH + 1)
    chain = optimal_tree(stats, CHAIN_DEPTH, max_depth=CHAIN_DEPTH, max_width=1)
    deeper = optimal_tree(stats, best.depth, max_depth=best.depth, max_width=1)
    ratio = estimate(chain, stats, latency, 1).speedup / estimate(deeper, stats, latency, 1).speedup
    assert 0.98 < ratio < 1.0


@pytest.mark.parametrize(
    ("modules", "chain_depths", "greedy", "sampled"),
    [
        (1, None, [CHAIN_DEPTH], [CHAIN_DEPTH]),  # DeepSeek-V3's one module: its last reused
        (CHAIN_DEPTH, None, [CHAIN_DEPTH], [CHAIN_DEPTH]),  # the demo model's four
        (CHAIN_DEPTH + 2, None, [CHAIN_DEPTH, CHAIN_DEPTH + 2], [CHAIN_DEPTH]),  # the gpu preset's six
        (CHAIN_DEPTH + 2, (3, 5), [3, 5], [3, 5]),  # set: for both kinds of batch
    ],
)
def test_chain_budgets_by_module_count_and_kind_of_batch(
    modules: int, chain_depths: tuple[int, ...] | None, greedy: list[int], sampled: list[int]
) -> None:
    """Adaptive speculation's chain arms (``chain_budgets``): chain-4, and for greedy batches of a
    model with more MTP modules a second one as deep as the modules; ``chain_depths`` sets both."""
    spec = SpecConfig(method="adaptive", chain_depths=chain_depths)
    for kind, depths in ((False, greedy), (True, sampled)):
        arms = chain_budgets(spec, modules, kind)
        assert [(a.topk, a.depth, a.num_draft_tokens) for a in arms] == [(1, d, d) for d in depths]


def _fixed(spec: str, stats: AcceptanceStats) -> TreeShape:
    """The optimal shape of a ``TOPKxDEPTH-N`` budget (what the planner assumes for it)."""
    width, rest = spec.split("x")
    depth, nodes = rest.split("-")
    return optimal_tree(stats, int(nodes), max_depth=int(depth), max_width=int(width))


def test_h200_inputs_rank_the_measured_shapes_as_the_h200_did() -> None:
    """The order the optimiser plans with: 4x6-32 above 4x8-40 above the chain at batch 1, as the
    H200 measured it (bench/results/h200-2026-12-01-shapes.md) and again,
    tree against chain, on the 16 prompts of session 34's shapes."""
    stats, latency = DERIVATIONS["cuda"].inputs()
    speed = {
        s: estimate(_fixed(s, stats), stats, latency, 1).speedup
        for s in ("1x4-4", "4x6-32", "4x8-40")
    }
    assert speed["4x6-32"] > speed["4x8-40"] > speed["1x4-4"] > 1.0


def test_derivations_read_the_shipped_measurements() -> None:
    for derivation in DERIVATIONS.values():
        stats_data = json.loads((DEFAULT_INPUTS / derivation.stats_file).read_text())
        latency_data = json.loads((DEFAULT_INPUTS / derivation.latency_file).read_text())
        assert stats_data["source"] and latency_data["source"]  # where the numbers come from
        stats, _ = derivation.inputs()
        # rank_accept is written next to the counters it was estimated from
        assert stats == AcceptanceStats.from_counts(
            stats_data["depth_rank_accepted"], stats_data["depth_reached"]
        )
        assert max(len(row) for row in stats.rank_accept) <= derivation.max_width


def test_the_documented_command_prints_the_cpu_default(capsys: pytest.CaptureFixture[str]) -> None:
    argv = shlex.split(DERIVATIONS["cpu"].command())
    assert argv[:2] == ["mtpserve", "simulate"]
    root = DEFAULT_INPUTS.parents[2]
    argv = [str(root / a) if a.endswith(".json") else a for a in argv[2:]]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        f"Default tree at batch 1: topk={CPU_TREE.topk} depth={CPU_TREE.depth} "
        f"num_draft_tokens={CPU_TREE.num_draft_tokens}"
    )


# ---- hand-made inputs whose answer is obvious --------------------------------------------------


def test_near_perfect_acceptance_and_flat_latency_give_the_largest_deepest_tree() -> None:
    stats = AcceptanceStats(tuple((0.97, 0.02) for _ in range(8)))
    flat = LatencyModel.analytic(verify_fixed=0.01, verify_per_token=0.0)  # drafts and nodes free
    budget = derive_default_budget(stats, flat, max_budget=32, max_depth=8, max_width=4)
    assert budget == TreeBudget(topk=2, depth=8, num_draft_tokens=32)


def test_poor_acceptance_and_steep_latency_give_a_small_tree() -> None:
    stats = AcceptanceStats(tuple((0.5, 0.1) for _ in range(8)))
    # every verified token costs a fifth of a step, every drafted depth a fifth too
    steep = LatencyModel.analytic(0.01, verify_per_token=0.002, draft_fixed=0.002)
    budget = derive_default_budget(stats, steep, min_path_prob=0.2)
    assert budget == TreeBudget(topk=1, depth=1, num_draft_tokens=1, min_path_prob=0.2)


def test_no_default_tree_when_speculation_never_pays() -> None:
    stats = AcceptanceStats(tuple((0.2, 0.05) for _ in range(8)))
    steep = LatencyModel.analytic(0.01, verify_per_token=0.002, draft_fixed=0.002)
    plan = best_budget(stats, steep, 1, range(33), 8, 4)
    assert plan.budget == 0
    assert budget_from_plan(plan).num_draft_tokens == 0
    with pytest.raises(ValueError, match="no speedup"):
        derive_default_budget(stats, steep)


def test_budget_holds_the_plans_tree() -> None:
    stats = AcceptanceStats(((0.6, 0.3, 0.05), (0.8, 0.1), (0.7,)))
    latency = LatencyModel.analytic(0.01, 0.0001, draft_fixed=0.0005)
    plan = best_budget(stats, latency, 1, range(13), 5, 3)
    budget = budget_from_plan(plan)
    shape = plan.shape
    assert budget.topk == max(len(shape.children(i)) for i in range(shape.num_nodes))
    assert budget.depth == max(shape.depths) and budget.num_draft_tokens == shape.budget
