"""Generation runs of one model on the same prompts in several decoding modes, timed.

A *mode* is a speculation method (``none`` = autoregressive, ``chain``, ``tree``) at a
temperature. Every mode gets a fresh engine, so its ``acceptance_snapshot()`` counts that mode
only; the engines load the same folder with the same device and dtype. Timing covers
``generate()`` alone (prefill included, engine construction excluded), after one warm-up
generation in the process so that one-time initialisation does not land on the first mode.

On a shared machine other processes steal cores in bursts, so one timing can be off by several
times. The modes are therefore timed in ``rounds`` interleaved rounds (every mode once per
round, on its own engine, same prompts and seed) and the fastest round counts: contention only
ever adds time. Statistics and tokens come from the first round (later rounds repeat them:
greedy is deterministic and sampling is seeded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.outputs import RequestOutput
from train.eval_metrics import repeated_ngram_share, summarize_outputs

SAMPLING_SEED = 0


@dataclass(frozen=True)
class Mode:
    method: str  # "none" | "chain" | "tree"
    temperature: float

    @property
    def name(self) -> str:
        label = "ar" if self.method == "none" else self.method
        return f"{label}@T{self.temperature:g}"


@dataclass(frozen=True)
class ModeRun:
    mode: Mode
    token_ids: list[list[int]]  # generated ids per prompt
    round_seconds: list[float]  # generate() wall time of each timing round
    summary: dict[str, Any]  # summarize_outputs()
    budget: dict[str, int]  # the resolved draft budget (topk, depth, num_draft_tokens)
    snapshot: dict[str, Any]  # LLMEngine.acceptance_snapshot(): the simulator's input

    @property
    def seconds(self) -> float:
        """The fastest round (see the module docstring)."""
        return min(self.round_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.summary["generated_tokens"] / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.mode.method,
            "temperature": self.mode.temperature,
            "draft_budget": self.budget,
            "seconds": self.seconds,
            "round_seconds": self.round_seconds,
            "tokens_per_s": self.tokens_per_s,
            **self.summary,
            "repeated_4gram_share": repeated_ngram_share(self.token_ids, 4),
            "acceptance_snapshot": self.snapshot,
        }


def _sampling(mode: Mode, max_tokens: int) -> SamplingParams:
    seed = None if mode.temperature == 0.0 else SAMPLING_SEED
    return SamplingParams(max_tokens=max_tokens, temperature=mode.temperature, seed=seed)


def warm_up(model_dir: str | Path, prompt: list[int], device: str, dtype: str) -> None:
    """One short speculative generation: pays the process's one-time start-up costs."""
    eng = LLMEngine.from_pretrained(
        model_dir, device=device, dtype=dtype, spec=SpecConfig(method="tree")
    )
    eng.generate(prompt_token_ids=[prompt], sampling=SamplingParams(max_tokens=4, temperature=0))


def _timed_generate(
    eng: LLMEngine, prompts: list[list[int]], sampling: SamplingParams
) -> tuple[list[RequestOutput], float]:
    start = time.perf_counter()
    outputs = eng.generate(prompt_token_ids=prompts, sampling=sampling)
    return outputs, time.perf_counter() - start


def run_modes(
    model_dir: str | Path,
    prompts: list[list[int]],
    modes: tuple[Mode, ...],
    max_tokens: int,
    device: str = "cpu",
    dtype: str = "float32",
    rounds: int = 3,
) -> dict[str, ModeRun]:
    """Every mode on the same prompts; ``rounds`` interleaved timing rounds (module docstring)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    engines: dict[str, LLMEngine] = {}
    runs: dict[str, ModeRun] = {}
    for mode in modes:
        spec = SpecConfig(method=mode.method)  # type: ignore[arg-type]
        eng = LLMEngine.from_pretrained(model_dir, device=device, dtype=dtype, spec=spec)
        outputs, seconds = _timed_generate(eng, prompts, _sampling(mode, max_tokens))
        budget = eng.budget
        runs[mode.name] = ModeRun(
            mode=mode,
            token_ids=[list(o.token_ids) for o in outputs],
            round_seconds=[seconds],
            summary=summarize_outputs(outputs),
            budget={
                "topk": budget.topk,
                "depth": budget.depth,
                "num_draft_tokens": budget.num_draft_tokens,
            },
            snapshot=dict(eng.acceptance_snapshot()),  # first round only
        )
        engines[mode.name] = eng
    for _ in range(rounds - 1):
        for mode in modes:
            _, seconds = _timed_generate(engines[mode.name], prompts, _sampling(mode, max_tokens))
            runs[mode.name].round_seconds.append(seconds)
    return runs
