"""Tiny random DeepSeek-V3 checkpoints for tests, written as real HF folders.

The main model is built and saved by transformers itself (the independent reference); MTP
modules, which transformers does not save for layers other than 61, are added as extra
safetensors tensors in the published layout (layer ``num_hidden_layers + i``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

BASE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=0,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=2,
    max_position_embeddings=512,
    num_nextn_predict_layers=2,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    initializer_range=0.08,
)


def make_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(BASE)
    cfg.update(overrides)
    return cfg


def build_checkpoint(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny DeepSeek-V3 folder (transformers layout + MTP layers)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    raw = make_config(**overrides)
    torch.manual_seed(seed)
    hf_cfg = DeepseekV3Config(**raw)
    model = DeepseekV3ForCausalLM(hf_cfg)
    with torch.no_grad():  # non-trivial norms and router bias so the test means something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(folder)
    _add_mtp_layers(folder, raw, seed)
    return folder


def _add_mtp_layers(folder: Path, raw: dict[str, Any], seed: int) -> None:
    from engine.model.config import ModelConfig
    from engine.model.deepseek_v3 import DeepseekV3ForCausalLM as Ours

    num = int(raw.get("num_nextn_predict_layers") or 0)
    if num == 0:
        return
    cfg_json = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(cfg_json)
    ours = Ours(cfg)
    ours.init_weights(seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    prefix = [f"model.layers.{cfg.num_hidden_layers + i}." for i in range(num)]
    extra = {}
    for name, tensor in ours.state_dict().items():
        if any(name.startswith(p) for p in prefix):
            t = tensor.clone()
            if "norm" in name:
                t = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
            extra[name] = t.contiguous()
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})
