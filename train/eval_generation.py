"""Generation runs of one model on the same prompts in several decoding modes, timed.

A *mode* is a speculation method (``none`` = autoregressive, ``chain``, ``tree``) at a
temperature. Every mode gets a fresh engine, so its ``acceptance_snapshot()`` counts that mode
only; the engines load the same folder with the same device and dtype. Statistics and tokens
come from one run of all prompts in one ``generate()`` batch.

Timing covers ``generate()`` alone (prefill included, engine construction excluded), after one
warm-up generation in the process, at two loads: *batched* (all prompts in one call) and
*batch 1* (one prompt per call, in turn). On a shared machine other processes steal cores in
bursts, so one timing can be off by several times; the modes are therefore timed in ``rounds``
interleaved rounds (every mode once per round, same prompts and seed) and the fastest round
counts, since contention only ever adds time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.outputs import RequestOutput
from engine.spec.drain import relative_yields
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

    def sampling(self, max_tokens: int) -> SamplingParams:
        seed = None if self.temperature == 0.0 else SAMPLING_SEED
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, seed=seed)


@dataclass
class ModeRun:
    mode: Mode
    token_ids: list[list[int]]  # generated ids per prompt (the batched run)
    summary: dict[str, Any]  # summarize_outputs() of the batched run
    budget: dict[str, int]  # the resolved draft budget (topk, depth, num_draft_tokens)
    snapshot: dict[str, Any]  # LLMEngine.acceptance_snapshot(): the simulator's input
    batched_s: list[float] = field(default_factory=list)  # one per round
    batch1_s: list[float] = field(default_factory=list)  # one per round
    batch1_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        batched, batch1 = min(self.batched_s), min(self.batch1_s)
        return {
            "method": self.mode.method,
            "temperature": self.mode.temperature,
            "draft_budget": self.budget,
            **self.summary,
            "repeated_4gram_share": repeated_ngram_share(self.token_ids, 4),
            "tokens_per_s": self.summary["generated_tokens"] / batched,
            "batch1_tokens_per_s": self.batch1_tokens / batch1,
            "round_seconds": {"batched": self.batched_s, "batch1": self.batch1_s},
            "acceptance_snapshot": self.snapshot,
        }


def _timed(
    eng: LLMEngine, prompts: list[list[int]], sampling: SamplingParams
) -> tuple[list[RequestOutput], float]:
    start = time.perf_counter()
    outputs = eng.generate(prompt_token_ids=prompts, sampling=sampling)
    return outputs, time.perf_counter() - start


def warm_up(model_dir: str | Path, prompt: list[int], device: str, dtype: str) -> None:
    """One short speculative generation: pays the process's one-time start-up costs."""
    spec = SpecConfig(method="tree")
    eng = LLMEngine.from_pretrained(model_dir, device=device, dtype=dtype, spec=spec)
    eng.generate(prompt_token_ids=[prompt], sampling=SamplingParams(max_tokens=4, temperature=0))


def _snapshot(eng: LLMEngine, outputs: list[RequestOutput]) -> dict[str, Any]:
    """The engine's acceptance counters and, for a drafting mode, the spread of the prompts'
    yields (``relative_yields``: what ``mtpserve simulate --closed-batch-tokens`` reads)."""
    snapshot = dict(eng.acceptance_snapshot())
    if eng.budget.speculates and "relative_yields" not in snapshot:
        per_sequence = [(o.stats.num_accepted_tokens + o.stats.num_steps, o.stats.num_steps) for o in outputs]
        yields = relative_yields(per_sequence)
        if yields:
            snapshot["relative_yields"] = yields
    return snapshot


def run_modes(
    model_dir: str | Path,
    prompts: list[list[int]],
    modes: tuple[Mode, ...],
    max_tokens: int,
    device: str = "cpu",
    dtype: str = "float32",
    rounds: int = 2,
) -> dict[str, ModeRun]:
    """Every mode on the same prompts; ``rounds`` interleaved timing rounds (module docstring)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    engines: dict[str, LLMEngine] = {}
    runs: dict[str, ModeRun] = {}
    for mode in modes:
        spec = SpecConfig(method=mode.method)  # type: ignore[arg-type]
        eng = LLMEngine.from_pretrained(model_dir, device=device, dtype=dtype, spec=spec)
        outputs, seconds = _timed(eng, prompts, mode.sampling(max_tokens))
        budget = eng.budget
        runs[mode.name] = ModeRun(
            mode=mode,
            token_ids=[list(o.token_ids) for o in outputs],
            summary=summarize_outputs(outputs),
            budget={
                "topk": budget.topk,
                "depth": budget.depth,
                "num_draft_tokens": budget.num_draft_tokens,
            },
            snapshot=_snapshot(eng, outputs),  # taken before the timing rounds
            batched_s=[seconds],
        )
        engines[mode.name] = eng
    for r in range(rounds):
        for mode in modes:
            eng, run = engines[mode.name], runs[mode.name]
            if r > 0:  # the statistics run above was the first batched round
                run.batched_s.append(_timed(eng, prompts, mode.sampling(max_tokens))[1])
            tokens, total = 0, 0.0
            for prompt in prompts:
                outputs, seconds = _timed(eng, [prompt], mode.sampling(max_tokens))
                tokens += len(outputs[0].token_ids)
                total += seconds
            run.batch1_s.append(total)
            run.batch1_tokens = tokens
    return runs
