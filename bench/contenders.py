"""Build the things under test from one model folder: engines per mode and the transformers model.

All engine modes share the weights of one loaded model (each engine has its own KV pool, sized
for the sweep's largest batch), so every mode runs the very same parameters. A mode that cannot
be built (for example ``adaptive`` while it is not implemented, or ``transformers-mtp`` on a folder
transformers cannot read MTP weights from) is returned with the reason instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine_run import BatchRun, run_batch
from bench.hf_baseline import HFBaseline, mtp_unavailable_reason
from bench.modes import ModeSpec
from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig

MIN_KV_BYTES = 64 << 20  # the probe engine's pool: room for every static path's padding
SCRATCH_TOKENS = 160  # per request: one step's draft scratch (num_draft_tokens + topk + 2), generous


@dataclass
class Contender:
    mode: ModeSpec
    engine: LLMEngine | None = None
    hf: HFBaseline | None = None

    def skip_reason(self, batch_size: int) -> str | None:
        if self.mode.mode == "transformers-mtp" and batch_size > 1:
            return "transformers' assisted generation (use_mtp) runs one sequence at a time"
        return None

    def run(self, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int) -> BatchRun:
        if self.engine is not None:
            # Greedy runs carry the seed (unused); sampled runs are unseeded like most API
            # traffic, which the graphed sampled step serves (a seeded request takes the
            # host-driven path to stay reproducible): the device generators get the seed.
            torch.manual_seed(seed)
            sampling = SamplingParams(max_tokens=new_tokens, temperature=temperature,
                                      seed=seed if temperature == 0 else None, ignore_eos=True)
            return run_batch(self.engine, prompts, sampling)
        assert self.hf is not None
        return self.hf.run(prompts, new_tokens, temperature,
                           use_mtp=self.mode.mode == "transformers-mtp", seed=seed)


def kv_bytes_for(engine: LLMEngine, batch: int, tokens_per_request: int) -> int:
    """KV pool bytes for ``batch`` requests of ``tokens_per_request`` tokens (plus scratch), at
    least ``MIN_KV_BYTES``: each engine's static paths also hold padding blocks (a prefill
    graph's rows, a tree step's scratch), which a sweep of batch 1 alone did not leave room for."""
    cfg = engine.model_config
    block = engine.config.block_size
    blocks = batch * (-(-(tokens_per_request + SCRATCH_TOKENS) // block)) + 8
    dtype_bytes = next(engine.model.parameters()).element_size()
    return max(int(blocks * block * cfg.latent_dim * cfg.num_layers_total * dtype_bytes * 1.1), MIN_KV_BYTES)


def load_base(model_dir: str, device: str, dtype: str, max_batch: int, tokens_per_request: int,
              kv_memory_mb: int | None, overlap_steps: bool | None = None,
              prefill_chunk_tokens: int | None = None, drafting_layer: bool | None = None,
              launch_after_prefill: bool = True, early_catch_up: bool = True) -> LLMEngine:
    """The autoregressive engine; its KV pool sized for the sweep unless ``kv_memory_mb``; its
    configuration (which every contender shares) with ``overlap_steps``,
    ``prefill_chunk_tokens``, ``drafting_layer`` (None: the engine's defaults),
    ``launch_after_prefill`` and ``early_catch_up``."""
    probe_cfg = EngineConfig(max_batch_size=max_batch, kv_memory_bytes=MIN_KV_BYTES)
    base = LLMEngine.from_pretrained(model_dir, device=device, dtype=dtype,
                                     spec=SpecConfig(method="none"), engine_config=probe_cfg)
    memory = kv_memory_mb * (1 << 20) if kv_memory_mb else kv_bytes_for(base, max_batch, tokens_per_request)
    config = EngineConfig(max_batch_size=max_batch, kv_memory_bytes=memory, overlap_steps=overlap_steps,
                          prefill_chunk_tokens=prefill_chunk_tokens, drafting_layer=drafting_layer,
                          launch_after_prefill=launch_after_prefill, early_catch_up=early_catch_up)
    return LLMEngine(base.model, base.tokenizer, base.eos_token_ids, SpecConfig(method="none"),
                     config, base.device)


def build_contenders(
    model_dir: str, base: LLMEngine, modes: list[ModeSpec], dtype: torch.dtype
) -> tuple[list[Contender], dict[str, str]]:
    """One contender per buildable mode, and ``{label: reason}`` for the others."""
    contenders: list[Contender] = []
    skipped: dict[str, str] = {}
    hf: HFBaseline | None = None
    for mode in modes:
        try:
            if mode.mode == "ar":
                contenders.append(Contender(mode, engine=base))
            elif mode.is_engine:
                assert mode.spec is not None
                eng = LLMEngine(base.model, base.tokenizer, base.eos_token_ids, mode.spec,
                                base.config, base.device)
                eng.use_acceptance_prior(model_dir)  # as ``from_pretrained`` does
                contenders.append(Contender(mode, engine=eng))
            else:
                reason = mtp_unavailable_reason(model_dir) if mode.mode == "transformers-mtp" else None
                if reason:
                    skipped[mode.label] = reason
                    continue
                hf = hf or HFBaseline(Path(model_dir), str(base.device), dtype)
                contenders.append(Contender(mode, hf=hf))
        except Exception as exc:  # a mode that cannot be built is reported, not fatal
            skipped[mode.label] = f"{type(exc).__name__}: {exc}"[:300]
    return contenders, skipped
