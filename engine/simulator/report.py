"""Text tables and the figure of ``mtpserve simulate``.

The figure has three panels: speedup against budget (one line per batch size, the best budget
marked), the same as a heatmap over batch size and budget, and the chosen tree drawn with each
node's path probability. Matplotlib's object API with the Agg canvas is used, so no global pyplot
state or display is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.expected import Estimate, node_probabilities
from engine.simulator.optimizer import SpeculationPlanner, TreePlan
from engine.simulator.tree_shape import TreeShape


def format_plans(plans: Sequence[TreePlan]) -> str:
    """One row per batch size: the chosen budget and its predicted performance."""
    lines = [
        f"{'batch':>6}{'budget':>8}{'depth':>7}{'topk':>6}{'E[len]':>9}"
        f"{'tokens/s':>12}{'AR tok/s':>12}{'speedup':>9}"
    ]
    for p in plans:
        lines.append(
            f"{p.batch_size:>6}{p.budget:>8}{p.max_depth:>7}{p.topk:>6}{p.expected_length:>9.3f}"
            f"{p.tokens_per_s:>12.1f}{p.ar_tokens_per_s:>12.1f}{p.speedup:>9.3f}"
        )
    return "\n".join(lines)


def format_estimates(estimates: Sequence[Estimate]) -> str:
    """One row per batch size for a given shape."""
    lines = [f"{'batch':>6}{'E[len]':>9}{'step ms':>10}{'tokens/s':>12}{'speedup':>9}"]
    for e in estimates:
        lines.append(
            f"{e.batch_size:>6}{e.expected_length:>9.3f}{e.step_seconds * 1e3:>10.3f}"
            f"{e.tokens_per_s:>12.1f}{e.speedup:>9.3f}"
        )
    return "\n".join(lines)


def _tree_layout(shape: TreeShape) -> tuple[list[float], list[float]]:
    """x = depth, y = leaves in depth-first rank order, a parent centred on its children."""
    x = [float(d) for d in shape.depths]
    y = [0.0] * shape.num_nodes
    next_leaf = 0.0

    def place(node: int) -> None:
        nonlocal next_leaf
        kids = shape.children(node)
        for c in kids:
            place(c)
        if kids:
            y[node] = (y[kids[0]] + y[kids[-1]]) / 2
        else:
            y[node] = next_leaf
            next_leaf += 1.0

    place(0)
    return x, y


def write_figure(
    path: str | Path,
    planner: SpeculationPlanner,
    batch_sizes: Sequence[int],
    plan: TreePlan,
    stats: AcceptanceStats,
) -> None:
    """Write the three-panel PNG (module docstring); ``plan`` is the tree drawn."""
    budgets = planner.budgets
    grid = planner.speedup_grid(batch_sizes)  # [batch, budget]
    fig = Figure(figsize=(16, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_lines, ax_heat, ax_tree = fig.subplots(1, 3, width_ratios=[1.2, 1.2, 1.0])

    for i, b in enumerate(batch_sizes):
        (line,) = ax_lines.plot(budgets, grid[i], marker=".", label=f"batch {b}")
        j = int(np.argmax(grid[i]))
        ax_lines.plot([budgets[j]], [grid[i, j]], "*", ms=12, color=line.get_color())
    ax_lines.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_lines.set_xlabel("draft-node budget (0 = autoregressive)")
    ax_lines.set_ylabel("predicted speedup over autoregressive")
    ax_lines.set_title("Speedup vs budget (★ = best)")
    ax_lines.legend(fontsize=8)

    im = ax_heat.imshow(grid, aspect="auto", origin="lower", cmap="viridis")
    ax_heat.set_yticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    step = max(1, len(budgets) // 12)
    ax_heat.set_xticks(range(0, len(budgets), step), [str(n) for n in budgets[::step]])
    ax_heat.set_xlabel("draft-node budget")
    ax_heat.set_ylabel("batch size")
    ax_heat.set_title("Predicted speedup")
    fig.colorbar(im, ax=ax_heat)

    shape = plan.shape
    probs = node_probabilities(shape, stats)
    x, y = _tree_layout(shape)
    for i in range(1, shape.num_nodes):
        p = shape.parents[i]
        ax_tree.plot([x[p], x[i]], [y[p], y[i]], color="grey", lw=0.8, zorder=1)
    points = ax_tree.scatter(x, y, c=probs, cmap="plasma", vmin=0, vmax=1, s=60, zorder=2)
    if shape.num_nodes <= 40:
        for i in range(1, shape.num_nodes):
            ax_tree.annotate(
                f"{probs[i]:.2f}",
                (x[i], y[i]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    fig.colorbar(points, ax=ax_tree, label="path probability")
    ax_tree.set_xlabel("depth")
    ax_tree.set_xticks(range(shape.max_depth + 1))
    ax_tree.set_yticks([])
    ax_tree.invert_yaxis()  # rank 0 (the drafter's top choice) on top
    ax_tree.set_title(
        f"Chosen tree at batch {plan.batch_size}: {plan.budget} nodes\n"
        f"E[len] {plan.expected_length:.2f}, speedup {plan.speedup:.2f}",
        fontsize=10,
    )
    fig.savefig(str(path), dpi=110)
