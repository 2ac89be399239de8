"""Write a trained model as a Hugging Face DeepSeek-V3 folder.

The folder holds ``config.json``, ``generation_config.json``, safetensors shards listed in
``model.safetensors.index.json`` (each shard at most ``max_shard_bytes``), and the tokenizer.
Tensor names are the model's state-dict names, which are the HF checkpoint names: MTP module
``i`` is decoder layer ``num_hidden_layers + i``. ``lm_head.weight`` is left out when tied to the
embedding, and the MTP modules never carry ``embed_tokens`` / ``shared_head.head`` (shared).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_HEADER_ALLOWANCE = 200  # bytes of safetensors header per tensor, counted against the shard limit


def export_tensors(
    state_dict: dict[str, torch.Tensor], tie_word_embeddings: bool, dtype: str
) -> dict[str, torch.Tensor]:
    """The tensors to save: CPU, contiguous, cast to ``dtype``, tied head removed."""
    if dtype not in _DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().to("cpu", _DTYPES[dtype]).contiguous().clone()
    return out


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy packing of tensors, in name order, into shards of at most ``max_shard_bytes``."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size() + _HEADER_ALLOWANCE
        if size > max_shard_bytes:
            raise ValueError(
                f"tensor {name} ({size} bytes) exceeds the shard limit {max_shard_bytes}"
            )
        if used + size > max_shard_bytes and shards[-1]:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save_weights(
    tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int
) -> dict[str, Any]:
    """Write the shards and their index; returns the index content."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("model*.safetensors"):
        stale.unlink()
    shards = plan_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(folder / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def write_configs(folder: Path, hf_config: dict[str, Any], dtype: str) -> None:
    """``config.json`` (with dtype) and ``generation_config.json`` (BOS/EOS/PAD)."""
    config = dict(hf_config)
    config.pop("rope_scaling", None)  # ``rope_parameters`` carries the RoPE settings
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config.get("pad_token_id"),
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def weight_bytes(folder: Path) -> int:
    """Bytes of all safetensors files in the folder (what the size limit of a preset counts)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
