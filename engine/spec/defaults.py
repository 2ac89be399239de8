"""Default draft-tree shapes per device, how they are derived, and SpecConfig -> TreeBudget.

The greedy default trees are the tree optimiser's choice at batch 1 (``derive_default_budget``:
``SpeculationPlanner`` picks the shape with the most predicted tokens/s; its widest node, deepest
node and node count become ``topk``, ``depth`` and ``num_draft_tokens``) on measured inputs
shipped in ``engine/spec/default_inputs/`` (written by ``scripts/default_tree_inputs.py``; each
file's ``source`` says how it was measured). The constants below are that choice written out, so
that importing this module computes nothing; ``tests/engine/simulator/test_defaults_derivation.py``
re-derives them from the shipped inputs, so the two cannot drift apart. Re-derive with the line
of ``DERIVATIONS[device].command()``, for the CPU::

    mtpserve simulate --stats engine/spec/default_inputs/cpu-demo-greedy-stats.json \\
        --latency engine/spec/default_inputs/cpu-demo-latency.json \\
        --budget 32 --max-depth 8 --max-width 4 --batch-sizes 1 --recommend-default

CPU (demo model, 2 threads): each drafted depth costs an MTP forward and host work (~1.9 ms
together, against a ~5 ms autoregressive step), so the best tree is narrow and about as deep as
the four trained MTP modules reach: 2 wide, 5 deep, 7 nodes. Its predicted speed is flat near the optimum (2x6-10 is
1.9% slower in the model); measured with the benchmark it was not slower than the previous 2x6-10
(README, "Speculation defaults"). Re-measured after the float32 GEMM layouts of
``engine.model.layers.Linear`` (session 9, ``bench/results/cpu-demo-*-session9.json``), the
inputs make the optimiser pick a chain of 3: greedy it measured 1.88x against 2x5-7's 1.73x, but
the default budget also fixes the sampled trees' shape, and as a chain it accepts 2.68 tokens
per step at T=1.0 against 3.30 (the demo model's goal is >= 3.0), so the shipped inputs and this
default stay.

GPU (gpu preset, H200, graphed greedy step; inputs of session 34): the acceptance of a full
top-4, depth-8 tree over 32 held-out prompts no sweep uses (640 steps), and whole graphed steps
of five fixed trees and the chain at batch 1 on the first 16 of them, fitted as 0.73 ms + 2.1
us per verified token + 82 us per drafted depth. A verify step costs about the same for tens
of tokens, so the tree is wide; the optimiser picks 4x6-32 (4x8-40 is 1.8% slower in the
model, 4x4-32 4.3%). Measured on those 16 prompts the trees 4x4-24 to 4x6-32 ran 2.39-2.47x
faster than autoregressive decoding, the same within the rounds' spread (``bench/results/h200-2026-12-04-session34-d515032-b1-shapes-offset256``):
depth 4 accepts fewer tokens per step (4.65 against 5.08 for 4x4-48 and 4x6-32) at a cheaper
step, a wash. 32 nodes is ``max_budget``: the model predicts 2.5% more at 48 nodes, less than the
spread between rounds of the measured shapes.
The chain arm (``CHAIN_DEPTH``) serves large batches, where each drafted depth costs more than
at batch 1 (chain-4 2.4 against 1.5 ms for an autoregressive step at batch 256): it is 4 deep,
one less than the optimiser's best chain at batch 1 (5 deep, 1.4% faster in the model). With
more MTP modules than that it stays 4 deep, though a graphed step runs every module (the deeper
ones over their catch-up rows): session 37 made it as deep as the modules (chain-6 on the six-
module `gpu` preset, whose chain-4 step had cost 10-19% more than with four modules), and
session 38's sweep (``bench/results/h200-2026-12-04-session38-4702819-sweep.md``) had chain-6
dearer per token than session 37's chain-4 where the chain serves: 0.51 against 0.47 ms at batch
128 and 0.82 against 0.72 at 256, greedy (0.36 against 0.37 at 64), its drain longer (16.8
against 11.4 ms at 128); batches 128 and 256 decoded autoregressively and ran 0.97x and 0.99x,
where session 37's chain-4 had drafted them at 1.06x and 1.17x.

Greedy batches of a model with more MTP modules than ``CHAIN_DEPTH`` get a second chain arm, as
deep as the modules (``chain_budgets``; the controller chooses between the arms per batch
bucket, and a tree step tells each chain what it would have yielded): on the six-module `gpu`
preset session 41 measured greedy batch 1 at 2.99-3.09x with chain-4 and chain-6 against
2.82-2.87x with chain-4 alone, and batch 256 at 0.99-1.10x against 0.95-0.98x, in three and two
runs (``bench/results/h200-2026-12-05-session41-e86edd0-ab*``). Sampled batches keep chain-4
only: a sampled chain-6 yielded 3.5-3.9 tokens against chain-4's 3.1-3.3 at a 10-50% dearer
step, and its exploring runs cost (T=0.7 medians 0.68-1.20x at batch 32 against 1.16-1.38x).

Session 37's `gpu` preset has six MTP modules (the four of session 34's inputs left depths 5
and 6 to the last one). Its statistics (``bench/results/h200-2026-12-04-session37-gpu6-greedy-
stats.json``, the 540 s model) make the optimiser pick 2x8-32 (accepted length 7.8 against 6.5
for 4x6-32, in the model). Measured at batch 1 on a 150 s model of the same shape it ran 2.37x
against 4x6-32's 2.35x, a wash, so the shipped inputs and this default stay.

``min_path_prob`` (EAGLE-2's confidence cut on greedy host-driven trees) is not the optimiser's:
it models fixed shapes; the cut was chosen by measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.params import SpecConfig
from engine.simulator import AcceptanceStats, LatencyModel, TreePlan, best_budget, optimal_tree
from engine.simulator.tree_shape import TreeShape
from engine.spec.drafter import TreeBudget

# Derived (module docstring); DERIVATIONS holds the inputs and limits they come from.
CPU_MIN_PATH_PROB = 0.15
CPU_TREE = TreeBudget(topk=2, depth=5, num_draft_tokens=7, min_path_prob=CPU_MIN_PATH_PROB)
# Derived (module docstring). Full trees (no confidence cut) keep CUDA graphs usable.
GPU_TREE = TreeBudget(topk=4, depth=6, num_draft_tokens=32)
CHAIN_DEPTH = 4  # the graphed chain arm, for large batches (module docstring)

DEFAULT_INPUTS = Path(__file__).with_name("default_inputs")


@dataclass(frozen=True)
class Derivation:
    """Measured inputs (files in ``DEFAULT_INPUTS``) and optimiser limits of one default tree.

    Limits: ``max_budget`` draft nodes, ``max_depth`` draft depths, ``max_width`` children per
    node (the depths and ranks the acceptance statistics were measured over).
    """

    stats_file: str
    latency_file: str
    max_budget: int
    max_depth: int
    max_width: int
    min_path_prob: float = 0.0
    batch_size: int = 1

    def inputs(self) -> tuple[AcceptanceStats, LatencyModel]:
        return (
            AcceptanceStats.from_json(DEFAULT_INPUTS / self.stats_file),
            LatencyModel.from_json(DEFAULT_INPUTS / self.latency_file),
        )

    def derive(self) -> TreeBudget:
        """The optimiser's budget on the shipped inputs (reads two small JSON files)."""
        stats, latency = self.inputs()
        return derive_default_budget(
            stats,
            latency,
            self.batch_size,
            self.max_budget,
            self.max_depth,
            self.max_width,
            self.min_path_prob,
        )

    def command(self) -> str:
        """The ``mtpserve simulate`` line that prints this derivation."""
        rel = DEFAULT_INPUTS.relative_to(DEFAULT_INPUTS.parents[2])
        return (
            f"mtpserve simulate --stats {rel / self.stats_file} --latency "
            f"{rel / self.latency_file} --budget {self.max_budget} --max-depth {self.max_depth} "
            f"--max-width {self.max_width} --batch-sizes {self.batch_size} --recommend-default"
        )


DERIVATIONS = {
    "cpu": Derivation(
        "cpu-demo-greedy-stats.json",
        "cpu-demo-latency.json",
        max_budget=32,
        max_depth=8,
        max_width=4,
        min_path_prob=CPU_MIN_PATH_PROB,
    ),
    "cuda": Derivation(
        "h200-gpu-greedy-stats.json",
        "h200-gpu-latency.json",
        max_budget=32,
        max_depth=8,
        max_width=4,
    ),
}


def budget_from_plan(plan: TreePlan, min_path_prob: float = 0.0) -> TreeBudget:
    """A drafter budget that holds the plan's tree: its widest node's children (``topk``), its
    deepest node (``depth``) and its node count (``num_draft_tokens``)."""
    if plan.budget == 0:
        return TreeBudget(topk=1, depth=0, num_draft_tokens=0)
    return TreeBudget(
        topk=plan.topk,
        depth=plan.max_depth,
        num_draft_tokens=plan.budget,
        min_path_prob=min_path_prob,
    )


def derive_default_budget(
    stats: AcceptanceStats,
    latency: LatencyModel,
    batch_size: int = 1,
    max_budget: int = 32,
    max_depth: int | None = 8,
    max_width: int | None = 4,
    min_path_prob: float = 0.0,
) -> TreeBudget:
    """The default greedy tree budget the optimiser gives for these measured inputs.

    Raises:
        ValueError: speculation does not pay at ``batch_size`` (the best plan drafts nothing).
    """
    plan = best_budget(stats, latency, batch_size, range(max_budget + 1), max_depth, max_width)
    if plan.budget == 0:
        raise ValueError(
            f"the optimiser predicts no speedup from speculation at batch {batch_size} on these "
            "inputs: there is no default tree to derive"
        )
    return budget_from_plan(plan, min_path_prob)


def chain_budgets(spec: SpecConfig, num_mtp_modules: int, sampled: bool) -> list[TreeBudget]:
    """Adaptive speculation's chain arms for greedy (or sampled) batches: ``spec.chain_depths``
    deep for both; by default one ``CHAIN_DEPTH`` deep and, for greedy batches of a model with
    more MTP modules than that, a second one as deep as the modules (module docstring)."""
    if spec.chain_depths is not None:
        depths = spec.chain_depths
    elif sampled or num_mtp_modules <= CHAIN_DEPTH:
        depths = (CHAIN_DEPTH,)
    else:
        depths = (CHAIN_DEPTH, num_mtp_modules)
    return [TreeBudget(topk=1, depth=d, num_draft_tokens=d) for d in depths]


def resolve_budget(spec: SpecConfig, device_type: str, vocab_size: int) -> TreeBudget:
    """The static budget of ``spec`` (``adaptive`` starts from the tree default)."""
    if spec.method == "none":
        return TreeBudget(topk=1, depth=0, num_draft_tokens=0)
    if spec.method == "chain":
        depth = spec.num_draft_tokens or spec.depth or CHAIN_DEPTH
        return TreeBudget(topk=1, depth=depth, num_draft_tokens=depth)
    base = GPU_TREE if device_type == "cuda" else CPU_TREE
    topk = min(spec.topk or base.topk, vocab_size)
    depth = spec.depth or base.depth
    budget = spec.num_draft_tokens or base.num_draft_tokens
    return TreeBudget(
        topk=topk,
        depth=depth,
        num_draft_tokens=budget,
        min_path_prob=base.min_path_prob if spec.min_path_prob is None else spec.min_path_prob,
    )


# Acceptance per depth and sibling rank assumed for sampled trees before live statistics exist
# (measured on the demo model at temperature 1.0, rounded down).
SAMPLED_PRIOR = AcceptanceStats(tuple((0.55, 0.12, 0.05, 0.02) for _ in range(8)))
LIVE_STATS_MIN_STEPS = 64


def sampled_tree_shape(budget: TreeBudget, snapshot: dict[str, object] | None) -> TreeShape:
    """The optimiser's best shape for sampled trees of this budget (one model of the trade-off).

    Children counts come from a node's position in the shape (its rank = draw order), never from
    drawn values, which keeps multi-draft rejection sampling exact.
    """
    stats = SAMPLED_PRIOR
    if snapshot is not None and int(snapshot.get("num_steps", 0)) >= LIVE_STATS_MIN_STEPS:  # type: ignore[call-overload]
        try:
            stats = AcceptanceStats.from_dict(snapshot)
        except ValueError:
            stats = SAMPLED_PRIOR
    return optimal_tree(
        stats, budget.num_draft_tokens, max_depth=budget.depth, max_width=budget.topk
    )
