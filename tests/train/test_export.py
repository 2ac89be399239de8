"""The exported folder: shards under the limit, the DeepSeek-V3 tensor layout with MTP modules at
layers L+i, and parity when transformers and the engine's loader read it back."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine.model.config import ModelConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.loader import load_model
from train.export import INDEX_NAME, export_tensors, plan_shards, save_weights, write_configs
from train.presets import DEMO, TINY, Preset

MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _model(preset: Preset, seed: int = 3) -> tuple[DeepseekV3ForCausalLM, dict]:
    hf = preset.hf_config(0, 1, 2)
    cfg = ModelConfig.from_hf_dict(hf)
    hf.update(cfg.to_hf_dict())
    model = DeepseekV3ForCausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():  # make norms non-trivial so that a misplaced one would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model, hf


def _export(model: DeepseekV3ForCausalLM, hf: dict, folder: Path, dtype: str, shard: int) -> dict:
    tensors = export_tensors(model.state_dict(), model.config.tie_word_embeddings, dtype)
    index = save_weights(tensors, folder, shard)
    write_configs(folder, hf, dtype)
    return index


PRESET = dataclasses.replace(TINY, q_lora_rank=16, tie_word_embeddings=True)


def test_layout_shards_and_configs(tmp_path: Path) -> None:
    model, hf = _model(PRESET)
    index = _export(model, hf, tmp_path, "float16", shard=150_000)
    L, k = PRESET.num_hidden_layers, PRESET.num_mtp_modules
    names = set(index["weight_map"])
    for i in range(k):
        for extra in MTP_EXTRA:
            assert f"model.layers.{L + i}.{extra}" in names
        assert f"model.layers.{L + i}.self_attn.kv_b_proj.weight" in names
        assert f"model.layers.{L + i}.mlp.down_proj.weight" in names
    assert not any(
        re.search(r"embed_tokens|shared_head\.head", n) for n in names if ".layers." in n
    )
    assert "lm_head.weight" not in names  # tied
    assert not any(n.startswith(f"model.layers.{L + k}.") for n in names)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) == len(set(index["weight_map"].values())) > 1
    assert all(p.stat().st_size <= 150_000 for p in shards)
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert all(f.get_tensor(n).dtype == torch.float16 for n in f.keys())  # noqa: SIM118
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == k and config["tie_word_embeddings"] is True
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    assert json.loads((tmp_path / INDEX_NAME).read_text())["metadata"]["total_size"] == sum(
        t.numel() * 2 for n, t in model.state_dict().items() if n != "lm_head.weight"
    )


def test_transformers_and_the_engine_loader_read_it_back_exactly(tmp_path: Path) -> None:
    model, hf = _model(PRESET)
    _export(model, hf, tmp_path, "float32", shard=400_000)
    x = torch.randint(0, PRESET.vocab_size, (2, 24))
    with torch.no_grad():
        ours = model.logits(model.forward_train(x))
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)(x).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        engine_model = load_model(tmp_path, dtype="float32")
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(engine_model.state_dict()[name], tensor, rtol=0, atol=0)
        h = engine_model.forward_train(x)
        h1 = engine_model.mtp_forward_train(1, h[:, :-2], x[:, 1:-1])
        torch.testing.assert_close(
            engine_model.logits(h1),
            model.logits(model.mtp_forward_train(1, model.forward_train(x)[:, :-2], x[:, 1:-1])),
        )


def test_shard_plan_respects_the_limit_and_refuses_oversized_tensors() -> None:
    tensors = {f"t{i}": torch.zeros(100, dtype=torch.float16) for i in range(10)}  # 200 B each
    shards = plan_shards(tensors, max_shard_bytes=1000)
    assert sorted(n for s in shards for n in s) == sorted(tensors)
    assert all(len(s) * (200 + 200) <= 1000 for s in shards)
    with pytest.raises(ValueError, match="exceeds the shard limit"):
        plan_shards({"big": torch.zeros(10_000)}, max_shard_bytes=1000)


def test_demo_preset_fits_the_shipping_limit() -> None:
    """fp16 weights of the demo shape, MTP modules included, stay under 40 MB (and 16 MB/shard)."""
    hf = DEMO.hf_config(0, 1, 2)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict(hf))
    sizes = {n: t.numel() * 2 for n, t in model.state_dict().items() if n != "lm_head.weight"}
    assert sum(sizes.values()) <= DEMO.max_weight_bytes
    assert max(sizes.values()) < DEMO.max_shard_bytes < 16 * 2**20
    assert model.config.num_nextn_predict_layers >= 3 and model.config.hidden_size >= 256
    assert model.config.max_position_embeddings >= 2048
