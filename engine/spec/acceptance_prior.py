"""The acceptance adaptive speculation assumes before it has counted any verify steps.

Adaptive speculation values a drafting arm by the tokens it yields per step, which the simulator
predicts from live acceptance statistics once enough verify steps were counted. Before that, an
arm's yield is unknown, and learning it costs a run that first catches the MTP modules up over
every prompt: at the H200's batch 256 (16384 prompt rows) that catch-up never fits the share of
a short batch's horizon an exploring run may take, so an engine whose first traffic is a large
batch never drafted at all, where a chain drafts at ~2x the tokens per second (the arm costs
measured in the session-15 sweep: 4.81 ms for 2.67 tokens against 3.93 ms for one).

A model folder trained by this project's recipe says what to expect: ``training_log.json``
holds each MTP module's agreement with the main model on held-out text, teacher-forced
(``final_heldout.accept_greedy``: its argmax equals the main model's; ``accept_sampled``: the
speculative-sampling acceptance ``E[sum min(p, q)]``; ``train.objectives``). Module ``d``'s rate
given the true prefix stands for P(depth d accepted | depth d-1 accepted): a lower bound in
practice, as the modules agree more after an accepted path than on average. Where the log also
has ``accept_greedy_rank`` (the share of positions where the main model's argmax is module
``d``'s rank-``r`` token), the greedy prior has those ranks too: a tree's siblings are valued
from the start. A chain-only prior values the tree as its rank-0 path, below a cheaper chain's
yield per step: the H200's batch 1 ran chain-4 for its first ~25 steps in some runs (2.77-2.87x
against 2.88-3.09x where the tree was chosen at once, session 42). Other folders (a
DeepSeek-V3 checkpoint) get the generic ``DEFAULT_PRIOR``. Either way the prior only stands in
until the first runs measure the arms: a measured yield outweighs it after a few sequence-steps
(``engine.spec.arm_measurements.YIELD_PRIOR_SEQ_STEPS``), and live statistics replace it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.simulator import AcceptanceStats

log = logging.getLogger(__name__)

DEFAULT_PRIOR = AcceptanceStats.chain([0.6, 0.5, 0.45, 0.4, 0.4, 0.4])
TRAINING_LOG = "training_log.json"
MAX_DEPTH = 8  # depths a prior covers: the last module's rate repeats (reused modules)


def acceptance_prior(folder: str | Path) -> dict[bool, AcceptanceStats]:
    """The prior per kind of step (False: greedy, True: sampled) for the model in ``folder``:
    its recipe's held-out agreement per MTP module where ``training_log.json`` has it, else
    ``DEFAULT_PRIOR``. An unreadable log is reported and ignored (it is not part of the
    checkpoint: the engine serves without it)."""
    path = Path(folder) / TRAINING_LOG
    prior = {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}
    if not path.is_file():
        return prior
    try:
        final = json.loads(path.read_text())["final_heldout"]
        for sampled, key in ((False, "accept_greedy"), (True, "accept_sampled")):
            prior[sampled] = _chain(final[key])
        if "accept_greedy_rank" in final:
            prior[False] = _ranked(final["accept_greedy_rank"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: no acceptance prior (%s: %s); using the default", path, type(exc).__name__, exc)
        return {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}
    return prior


def _ranked(rows: object) -> AcceptanceStats:
    """Per-depth, per-rank statistics from per-module rank rates, the last depth repeated to
    ``MAX_DEPTH`` (``AcceptanceStats`` validates them: ranks of a depth sum to at most 1)."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        raise ValueError(f"per-module rank rates must be a non-empty list of non-empty lists, got {rows!r}")
    values = [[float(v) for v in row] for row in rows]
    values += [values[-1]] * (MAX_DEPTH - len(values))
    return AcceptanceStats(tuple(tuple(row) for row in values[:MAX_DEPTH]))


def _chain(rates: object) -> AcceptanceStats:
    """Chain statistics from per-module rates, the last one repeated to ``MAX_DEPTH``."""
    if not isinstance(rates, list) or not rates:
        raise ValueError(f"per-module rates must be a non-empty list, got {rates!r}")
    values = [float(r) for r in rates]
    if not all(0.0 <= r <= 1.0 for r in values):
        raise ValueError(f"rates must lie in [0, 1], got {values}")
    values += [values[-1]] * (MAX_DEPTH - len(values))
    return AcceptanceStats.chain(values[:MAX_DEPTH])
