"""Expected accepted length, throughput and speedup of a tree shape under the model.

Terms:
  - *path probability* of a node: P(the accepted path passes through it) =
    P(parent) * ``rank_accept[depth(parent)][rank]``; the root's is 1.
  - *accepted length* (tokens per verify step, ``SpecStats.mean_accepted_length``): accepted
    drafts + the bonus token, so its expectation is ``1 + sum of the draft nodes' path
    probabilities`` (linearity of expectation: a node contributes one token when it is accepted).
  - *step time* at batch ``b``: ``verify(b, N + 1)`` + one MTP forward per draft depth (over the
    nodes of the depth above that have children) + the per-step overhead. A shape without draft
    nodes is plain autoregressive decoding: ``verify(b, 1)``.
  - *tokens/s* = ``b * E[accepted length] / step time``; *speedup* = tokens/s over the
    autoregressive ``b / verify(b, 1)``.
  - *closed batch* (``closed_batch_estimate``): ``b`` sequences with ``T`` tokens each and no
    newcomers. Autoregressive decoding finishes them in ``T`` steps; drafting when its hardest
    sequence finishes, each sequence needing ``T / (E[len] * r)`` steps at its relative yield
    ``r`` (the spread of yields over sequences, measured by adaptive speculation). The cost is
    ``engine.spec.drain.closed_batch_seconds``, the function adaptive speculation charges a
    drafting arm's drain with: the scheduler and the simulator share this model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.simulator.acceptance import AcceptanceStats
from engine.simulator.latency import LatencyModel
from engine.simulator.tree_shape import TreeShape
from engine.spec.drain import closed_batch_seconds


def node_probabilities(shape: TreeShape, stats: AcceptanceStats) -> list[float]:
    """``[i]`` = path probability of node ``i`` (root included, = 1)."""
    depths = shape.depths
    probs = [1.0] * shape.num_nodes
    for i in range(1, shape.num_nodes):
        parent = shape.parents[i]
        probs[i] = probs[parent] * stats.prob(depths[parent], shape.ranks[i])
    return probs


def expected_length(shape: TreeShape, stats: AcceptanceStats) -> float:
    """E[tokens emitted per verify step] = 1 + sum of the draft nodes' path probabilities."""
    return 1.0 + sum(node_probabilities(shape, stats)[1:])


def expected_accepted_per_position(shape: TreeShape, stats: AcceptanceStats) -> list[float]:
    """``[d]`` = P(the accepted path reaches depth ``d + 1``); compare with
    ``SpecStats.accepted_per_position[d] / num_steps``."""
    out = [0.0] * shape.max_depth
    for p, depth in zip(node_probabilities(shape, stats), shape.depths, strict=True):
        if depth > 0:
            out[depth - 1] += p
    return out


def step_seconds(shape: TreeShape, latency: LatencyModel, batch_size: int) -> float:
    """Seconds of one decoding step of ``batch_size`` sequences that all use ``shape``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    decode = latency.decode_overhead_seconds
    if shape.budget == 0:
        return latency.verify_seconds(batch_size, 1) + decode
    depths = [n for n in shape.expanded_per_depth() if n]
    draft = sum(latency.draft_seconds(batch_size, n) for n in depths)
    overhead = latency.step_overhead_seconds + latency.depth_overhead_seconds * len(depths)
    return latency.verify_seconds(batch_size, shape.num_nodes) + draft + overhead + decode


def ar_tokens_per_second(latency: LatencyModel, batch_size: int) -> float:
    """Autoregressive throughput: ``batch_size`` tokens per autoregressive step."""
    return batch_size / (latency.verify_seconds(batch_size, 1) + latency.decode_overhead_seconds)


@dataclass(frozen=True)
class Estimate:
    """The model's prediction for one shape at one batch size."""

    batch_size: int
    expected_length: float
    step_seconds: float
    tokens_per_s: float
    ar_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.ar_tokens_per_s


def estimate(
    shape: TreeShape, stats: AcceptanceStats, latency: LatencyModel, batch_size: int
) -> Estimate:
    """Expected length, tokens/s and speedup of ``shape`` at ``batch_size``."""
    length = expected_length(shape, stats)
    seconds = step_seconds(shape, latency, batch_size)
    return Estimate(
        batch_size=batch_size,
        expected_length=length,
        step_seconds=seconds,
        tokens_per_s=batch_size * length / seconds,
        ar_tokens_per_s=ar_tokens_per_second(latency, batch_size),
    )


def closed_batch_estimate(
    shape: TreeShape,
    stats: AcceptanceStats,
    latency: LatencyModel,
    batch_size: int,
    tokens: int,
    relative_yields: Sequence[float],
) -> Estimate:
    """``estimate`` for a closed batch of ``batch_size`` sequences that each generate ``tokens``
    (module docstring): the batch drains over its last steps as its sequences' yields spread
    (``relative_yields``, 1 = the mean); ``step_seconds`` is the mean step of the whole run."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if not relative_yields or any(r <= 0 for r in relative_yields):
        raise ValueError("relative_yields must be a non-empty list of positive numbers")
    length = expected_length(shape, stats)
    steps = tokens / length
    seconds = closed_batch_seconds(
        lambda alive: step_seconds(shape, latency, max(round(alive), 1)), batch_size, steps,
        list(relative_yields),
    )  # fmt: skip
    return Estimate(
        batch_size=batch_size,
        expected_length=length,
        step_seconds=seconds / steps,
        tokens_per_s=batch_size * tokens / seconds,
        ar_tokens_per_s=ar_tokens_per_second(latency, batch_size),
    )
