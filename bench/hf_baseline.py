"""transformers' ``generate()`` on the same folder: the outside baseline.

Prompts of one batch have equal length, so batched ``generate()`` needs no padding and its
greedy tokens are comparable with the engine's token for token. ``use_mtp=True`` (transformers'
own MTP speculative decoding) reads MTP weights at decoder layer 61 only and builds them as MoE,
so it runs only on folders with the published 61-layer layout, and only at batch size 1
(assisted generation is single-sequence). Timing: the wall time of ``generate()``; TTFT from a
separate one-token ``generate()`` of the same batch, so no streamer slows the timed loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_run import BatchRun, synchronize

MTP_LAYER = 61


def mtp_unavailable_reason(model_dir: str | Path) -> str | None:
    """Why ``generate(use_mtp=True)`` cannot run on this folder, or None if it can."""
    from transformers import GenerationConfig

    if not hasattr(GenerationConfig(), "use_mtp"):
        import transformers

        return f"transformers {transformers.__version__} has no generate(use_mtp=True)"
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, nextn = cfg.get("num_hidden_layers"), cfg.get("num_nextn_predict_layers") or 0
    if layers != MTP_LAYER or nextn < 1:
        return (f"transformers reads MTP weights at layer {MTP_LAYER} only; this folder has "
                f"{layers} layers and {nextn} MTP modules")
    if (cfg.get("n_routed_experts") or 0) == 0 or cfg.get("first_k_dense_replace", 0) > MTP_LAYER:
        return "transformers builds the MTP layer as MoE; this folder's MTP layer is dense"
    return None


class HFBaseline:
    """A transformers model loaded once; ``run`` generates one batch."""

    def __init__(self, model_dir: str | Path, device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the engine-only MTP tensors are "unexpected" to it
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device)
        self.model.eval()
        self.pad_id = int(self.model.config.pad_token_id or 0)

    def _config(self, new_tokens: int, temperature: float, use_mtp: bool) -> Any:
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = dict(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
            pad_token_id=self.pad_id,
        )
        if temperature > 0:  # plain temperature sampling, as the engine's SamplingParams defaults
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if use_mtp:
            kwargs["use_mtp"] = True
        return GenerationConfig(**kwargs)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float,
                 use_mtp: bool = False, seed: int = 0) -> tuple[list[list[int]], float]:
        """Generated ids per prompt and the wall time of the call."""
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("prompts of one batch must have equal length (no padding)")
        ids = torch.tensor(prompts, device=self.device)  # [B, T]
        mask = torch.ones_like(ids)
        config = self._config(new_tokens, temperature, use_mtp)
        torch.manual_seed(seed)
        synchronize(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        synchronize(self.device)
        wall = time.perf_counter() - t0
        return out[:, ids.shape[1]:].tolist(), wall

    def run(self, prompts: list[list[int]], new_tokens: int, temperature: float,
            use_mtp: bool = False, seed: int = 0) -> BatchRun:
        _, first_s = self.generate(prompts, 1, temperature, use_mtp, seed)
        tokens, wall = self.generate(prompts, new_tokens, temperature, use_mtp, seed)
        n = len(tokens[0])
        tpot = (wall - first_s) / (n - 1) if n > 1 else 0.0
        return BatchRun(wall, tokens, [first_s] * len(prompts), [max(tpot, 0.0)] * len(prompts))
