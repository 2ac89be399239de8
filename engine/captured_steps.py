"""The engine's static-shape decode steps, built once at start-up (CUDA graphs on a GPU).

On a GPU eager PyTorch is dominated by launch overhead, so every step the engine takes over and
over is a static-shape program captured as CUDA graphs per batch bucket, with static buffers:
the target's forward for autoregressive, verify and prefill shapes (``StaticTargetForward``),
the MTP modules' catch-up over the rows they are behind (``GraphedCatchUp``), and one whole
tree step per draft budget (``GraphedGreedyTree`` for greedy batches, ``GraphedSampledTree``
for sampled ones): the engine's budget and, under adaptive speculation, the chain arms. On a
CPU the same code runs eagerly (``use_graphs=False``), which is how CI tests it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.cuda_graphs import DEFAULT_PREFILL_TOKENS, StaticTargetForward
from engine.kv.block_pool import BlockPool
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.draft_layer import DraftLayer, draft_layers
from engine.params import EngineConfig, SpecConfig
from engine.spec.adaptive import budget_label
from engine.spec.defaults import sampled_tree_shape
from engine.spec.drafter import TreeBudget
from engine.spec.graphed_catch_up import GraphedCatchUp
from engine.spec.graphed_sampled import GraphedSampledTree
from engine.spec.graphed_tree import GraphedGreedyTree, GraphedTreeStep
from engine.startup_timer import StartupTimer


@dataclass
class CapturedSteps:
    """What ``capture_steps`` built; the engine takes each part over."""

    static_forward: StaticTargetForward
    # The MTP modules' drafting forward (engine/model/draft_layer.py), shared by the catch-up
    # and every tree step (empty: nothing drafts on the static path).
    draft_layers: dict[int, DraftLayer] = field(default_factory=dict)
    catch_up: GraphedCatchUp | None = None
    # Every tree step, (greedy, sampled) per budget, the engine's budget first.
    runners: list[GraphedTreeStep] = field(default_factory=list)


def capture_steps(
    model: DeepseekV3ForCausalLM,
    pool: BlockPool,
    spec: SpecConfig,
    config: EngineConfig,
    budget: TreeBudget,
    chains: dict[bool, list[TreeBudget]],
    max_blocks: int,
    prefill_chunk: int,
    drafts: bool,
    timer: StartupTimer,
) -> CapturedSteps:
    """Build the static steps: the target's forward; where ``drafts`` (the engine keeps MTP
    state) and ``budget`` speculates, the catch-up and the tree steps of ``budget`` and of the
    chain arms ``chains`` (sampled -> budgets; adaptive speculation only). ``max_blocks``: KV
    blocks a sequence's table may list; each stage is timed by ``timer``."""
    use_graphs = pool.kv_cache.device.type == "cuda"
    max_batch = config.max_batch_size
    with timer.stage("target_graphs"):  # decode and prefill shapes
        static_forward = StaticTargetForward(
            model, pool, (1, budget.num_draft_tokens + 1), max_blocks, max_batch, use_graphs=use_graphs,
            prefill_tokens=DEFAULT_PREFILL_TOKENS, prefill_chunk=prefill_chunk,
        )  # fmt: skip
    captured = CapturedSteps(static_forward)
    if not (drafts and budget.speculates):
        return captured
    captured.draft_layers = draft_layers(model, config.drafting_layer)
    with timer.stage("catch_up_graphs"):
        captured.catch_up = GraphedCatchUp(model, pool, max_blocks, max_batch, use_graphs=use_graphs,
                                           draft_layers=captured.draft_layers)  # fmt: skip
    budgets = [budget]
    if spec.method == "adaptive":  # chain arms too, for large batches
        budgets += [b for b in dict.fromkeys([*chains[False], *chains[True]]) if b != budget]
    for arm in budgets:
        kinds = [s for s in (False, True) if arm == budget or arm in chains[s]]
        with timer.stage(f"tree_graphs:{budget_label(arm)}"):
            captured.runners += _tree_steps(model, pool, spec, arm, kinds, max_blocks, max_batch,
                                            captured.draft_layers, use_graphs)  # fmt: skip
    return captured


def _tree_steps(
    model: DeepseekV3ForCausalLM,
    pool: BlockPool,
    spec: SpecConfig,
    budget: TreeBudget,
    kinds: list[bool],
    max_blocks: int,
    max_batch: int,
    drafting: dict[int, DraftLayer],
    use_graphs: bool,
) -> list[GraphedTreeStep]:
    """The tree steps of ``budget`` for greedy (False in ``kinds``) and sampled (True) batches,
    greedy first."""
    reuse = spec.reuse_last_module
    runners: list[GraphedTreeStep] = []
    if False in kinds:
        runners.append(GraphedGreedyTree(model, pool, budget, max_blocks, max_batch, use_graphs=use_graphs,
                                         reuse_last_module=reuse, draft_layers=drafting))  # fmt: skip
    if True in kinds:
        # Without reuse of the last module, no draft is deeper than the modules.
        depth = budget.depth if reuse else min(budget.depth, model.config.num_mtp_modules)
        shape = sampled_tree_shape(dataclasses.replace(budget, depth=depth), None)
        runners.append(GraphedSampledTree(model, pool, budget, shape, max_blocks, max_batch, use_graphs=use_graphs,
                                          reuse_last_module=reuse, draft_layers=drafting))  # fmt: skip
    return runners


def uses_static_steps(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine builds static steps (``EngineConfig.cuda_graphs``; default: on CUDA)."""
    return device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
