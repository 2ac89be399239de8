"""Models of a training preset's shape with random weights, for the diagnosis tools: what a
step costs and which kernels it runs do not depend on the weights, so no training is needed."""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM


def preset_config(preset: str) -> ModelConfig:
    """The engine's config of ``train.presets``' ``preset`` (``gpu``, ``demo``, ``tiny``)."""
    from train.presets import PRESETS  # noqa: PLC0415 (the recipe's module, only when asked)

    return ModelConfig.from_hf_dict(PRESETS[preset].hf_config(0, 1, 2))


def random_model(preset: str, device: torch.device) -> DeepseekV3ForCausalLM:
    """``preset``'s model, matrices N(0, 0.02) and vectors 1 (seed 0), in eval mode on ``device``:
    bfloat16 on a GPU, float32 on a CPU."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(preset_config(preset))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model = model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return model.eval()
