"""The simulator's latency model from a live engine's measured arm costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.simulator.arm_costs import fit_arm_costs, latency_from_arm_costs, load_arm_costs
from engine.simulator.cli import main
from engine.simulator.expected import step_seconds
from engine.simulator.tree_shape import TreeShape

CHAIN = TreeShape(parents=(-1, 0, 1, 2, 3), ranks=(0, 0, 0, 0, 0))  # 4 nodes, depth 4
# 8 nodes, depth 6: a spine of six and two second children.
TREE = TreeShape(parents=(-1, 0, 1, 2, 3, 4, 5, 0, 1), ranks=(0, 0, 0, 0, 0, 0, 0, 1, 1))


def _record(b: float, arm: str, depth: int, nodes: int, ms: float, sampled: bool = False) -> dict[str, object]:
    return {"batch_size": b, "sampled": sampled, "arm": arm, "topk": 1, "depth": depth,
            "num_draft_tokens": nodes, "step_seconds": ms / 1e3, "tokens_per_seq": 1.0, "steps": 5}  # fmt: skip


def test_two_drafting_arms_are_reproduced_exactly_by_the_simulators_step_time() -> None:
    """With the autoregressive step and two drafting arms of different shapes at one batch
    size, the fitted model gives each of them its measured step time, through the same
    ``step_seconds`` the optimiser uses (hand-solved: 4 beta + 4 delta = 1.5 ms,
    8 beta + 6 delta = 2.5 ms -> beta = 0.125, delta = 0.25 ms)."""
    costs = load_arm_costs([_record(64, "none", 0, 0, 1.5), _record(64, "chain-4", 4, 4, 3.0),
                            _record(64, "tree-2x6-8", 6, 8, 4.0)])  # fmt: skip
    (fit,) = fit_arm_costs(costs)
    assert (fit.batch_size, fit.autoregressive) == (64, pytest.approx(1.5e-3))
    assert fit.per_token == pytest.approx(0.125e-3) and fit.per_depth == pytest.approx(0.25e-3)
    latency = latency_from_arm_costs(costs)
    assert step_seconds(TreeShape(parents=(-1,), ranks=(0,)), latency, 64) == pytest.approx(1.5e-3)
    assert step_seconds(CHAIN, latency, 64) == pytest.approx(3.0e-3)
    assert step_seconds(TREE, latency, 64) == pytest.approx(4.0e-3)


def test_one_drafting_arm_takes_the_verify_as_flat_and_fits_never_go_negative() -> None:
    one = fit_arm_costs(load_arm_costs([_record(1, "none", 0, 0, 1.0), _record(1, "tree", 6, 32, 2.2)]))
    assert one[0].per_token == 0 and one[0].per_depth == pytest.approx(0.2e-3)
    # Unconstrained, these two arms solve to a negative per-token cost: it is clamped to zero
    # and the depth term takes the least-squares fit of both.
    clamped = fit_arm_costs(load_arm_costs([_record(4, "none", 0, 0, 1.0), _record(4, "a", 2, 2, 2.0),
                                            _record(4, "b", 4, 32, 2.9)]))  # fmt: skip
    assert clamped[0].per_token == 0.0
    assert clamped[0].per_depth == pytest.approx((2 * 1.0 + 4 * 1.9) / (2 * 2 + 4 * 4) * 1e-3)


def test_batches_are_fitted_apart_and_greedy_and_sampled_costs_are_kept_apart() -> None:
    costs = load_arm_costs({"arm_costs": [
        _record(1, "none", 0, 0, 1.0), _record(1, "chain-4", 4, 4, 1.8),
        _record(60.7, "none", 0, 0, 2.0), _record(60.7, "chain-4", 4, 4, 4.0),
        _record(1, "none", 0, 0, 1.4, sampled=True), _record(1, "chain-4", 4, 4, 3.0, sampled=True),
    ]})  # fmt: skip
    greedy = fit_arm_costs(costs)
    assert [(f.batch_size, round(f.per_depth * 1e3, 6)) for f in greedy] == [(1, 0.2), (61, 0.5)]
    (sampled,) = fit_arm_costs(costs, sampled=True)
    assert sampled.autoregressive == pytest.approx(1.4e-3) and sampled.per_depth == pytest.approx(0.4e-3)
    latency = latency_from_arm_costs(costs)
    assert step_seconds(CHAIN, latency, 1) == pytest.approx(1.8e-3)
    assert step_seconds(CHAIN, latency, 61) == pytest.approx(4.0e-3)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([_record(8, "chain-4", 4, 4, 2.0)], "no greedy batch size has an autoregressive step"),
        ([{"arm": "none", "step_seconds": 0.001}], r"\[0\]: an arm cost needs batch_size"),
        ([_record(8, "none", 0, 0, -1.0)], "step_seconds must be positive"),
        ([_record(8, "x", 0, 4, 1.0)], "both 0"),
        ({"num_steps": 3}, "expected a list of arm costs or an object with 'arm_costs'"),
    ],
)
def test_bad_arm_costs_are_named(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_arm_costs(load_arm_costs(data))


def test_a_live_adaptive_engines_snapshot_drives_mtpserve_simulate(
    small_vocab_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adaptive engine's acceptance snapshot carries the arms it measured; ``mtpserve
    simulate --arm-costs`` fits its latency model to them and reproduces their step times."""
    eng = LLMEngine.from_pretrained(small_vocab_dir, spec=SpecConfig(method="adaptive"),
                                    engine_config=EngineConfig(cuda_graphs=True))  # fmt: skip
    assert eng.adaptive is not None
    arms = eng.graphed_budgets(False)
    from engine.spec.adaptive import NO_SPEC

    picks = iter(([NO_SPEC] * 6 + [arms[0]] * 6 + [arms[-1]] * 6) * 20)
    eng.adaptive.choose = lambda *a, **k: next(picks)  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng.generate([[1, 2, 3, 4, 5], [2, 3, 4, 5, 1]], sp)
    snapshot = eng.acceptance_snapshot()
    labels = {r["arm"] for r in snapshot["arm_costs"]}  # type: ignore[attr-defined]
    assert "none" in labels and len(labels) >= 2, labels
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps(snapshot))
    rc = main(["--stats", str(path), "--arm-costs", str(path), "--budget", "8", "--batch-sizes", "1", "2",
               "--out", str(tmp_path / "sim.png")])  # fmt: skip
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "arm"])
    end = next(i for i, line in enumerate(lines) if line.startswith("fitted per batch size"))
    rows = [line.split() for line in lines[header + 1 : end]]
    assert {r[1] for r in rows} == labels
    for _, arm, _, step_ms, model_ms, _ in rows:  # the baseline is fitted exactly
        if arm == "none":
            assert float(model_ms) == pytest.approx(float(step_ms), abs=1e-3)
    assert any("Best speculation per batch size" in line for line in lines)


def test_simulate_needs_exactly_one_latency_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--stats", "s.json"])
    assert "one of the arguments --latency --arm-costs is required" in capsys.readouterr().err
