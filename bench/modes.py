"""The modes the offline benchmark compares, and how each is configured.

Engine modes run through ``LLMEngine`` (``ar`` is ``SpecConfig(method="none")``); ``tree`` can
appear several times with different draft budgets (``tree-8``, ``tree-32``...). The transformers
modes are baselines on the same folder: plain ``generate()`` and, where transformers can read the
folder's MTP weights (the published 61-layer layout), ``generate(use_mtp=True)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import SpecConfig

ENGINE_MODES = ("ar", "chain", "tree", "adaptive")
HF_MODES = ("transformers", "transformers-mtp")
ALL_MODES = ENGINE_MODES + HF_MODES


@dataclass(frozen=True)
class ModeSpec:
    mode: str  # one of ALL_MODES
    label: str  # unique name of the configuration: "ar", "tree-8", ...
    spec: SpecConfig | None = None  # engine modes only

    @property
    def is_engine(self) -> bool:
        return self.mode in ENGINE_MODES


def _tree_mode(budget: int | str) -> ModeSpec:
    """``32`` -> the default shape with 32 draft tokens; ``"4x8-40"`` -> topk 4, depth 8, 40 tokens."""
    if isinstance(budget, int) or budget.isdigit():
        b = int(budget)
        return ModeSpec("tree", f"tree-{b}" if b else "tree", SpecConfig(method="tree", num_draft_tokens=b or None))
    return ModeSpec("tree", f"tree-{budget}", _shape_spec("tree", budget))


def _shape_spec(method: str, budget: str) -> SpecConfig:
    """``"4x8-40"`` -> a ``method`` config of topk 4, depth 8, 40 draft tokens."""
    try:
        width, rest = budget.split("x")
        depth, tokens = rest.split("-")
        return SpecConfig(method=method, topk=int(width), depth=int(depth), num_draft_tokens=int(tokens))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"tree budget {budget!r}: expected N or TOPKxDEPTH-N, e.g. 32 or 4x8-40") from exc


def build_modes(
    modes: list[str], tree_budgets: list[int | str], adaptive_tree: str | None = None,
    adaptive_chains: list[int] | None = None,
) -> list[ModeSpec]:
    """Mode specs in run order; ``ar`` first since every other mode is compared with it.
    ``adaptive_tree`` (``TOPKxDEPTH-N``): the adaptive mode's tree arm instead of the default;
    ``adaptive_chains``: the depths of its chain arms (``SpecConfig.chain_depths``)."""
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(ALL_MODES)}")
    out = [ModeSpec("ar", "ar", SpecConfig(method="none"))]
    for mode in modes:
        if mode == "chain":
            out.append(ModeSpec("chain", "chain", SpecConfig(method="chain")))
        elif mode == "tree":
            for b in tree_budgets or [0]:  # 0: the device default shape
                out.append(_tree_mode(b))
        elif mode == "adaptive":
            spec = _shape_spec("adaptive", adaptive_tree) if adaptive_tree else SpecConfig(method="adaptive")
            if adaptive_chains:
                spec = dataclasses.replace(spec, chain_depths=tuple(adaptive_chains))
            out.append(ModeSpec("adaptive", "adaptive", spec))
        elif mode in HF_MODES:
            out.append(ModeSpec(mode, mode))
    return out
