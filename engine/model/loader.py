"""Load a Hugging Face DeepSeek-V3 folder into ``DeepseekV3ForCausalLM``.

Single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Tensors are
read through safetensors' memory map one at a time and cast straight into the parameter, so the
checkpoint is never held twice. Every problem gets a precise message: which tensor is missing,
which has which wrong shape, which shard file is absent.

Tensors that exist in the published layout but are not needed are skipped: per-MTP-module copies
of ``embed_tokens`` and ``shared_head.head`` (the main model's are shared, never copied), and MTP
layers beyond ``num_nextn_predict_layers``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.moe import TopkRouter
from engine.model.rope import RotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """The model folder is broken; the message says exactly how."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name} listed in {index.name} is missing from {folder}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as handle:
            return {name: single for name in handle.keys()}  # noqa: SIM118
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def _skip(name: str, cfg: ModelConfig) -> bool:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if not match:
        return False
    layer = int(match.group(1))
    if layer >= cfg.num_layers_total:
        return True  # MTP layers we were not asked to use
    if layer >= cfg.num_hidden_layers:
        return ".embed_tokens." in name or ".shared_head.head." in name
    return False


def _present_mtp_modules(cfg: ModelConfig, files: dict[str, Path]) -> ModelConfig:
    """Use only the MTP modules the checkpoint has.

    A folder whose config declares MTP modules but holds no tensor at all for them (what
    transformers' ``save_pretrained`` writes) still serves autoregressively; the engine then
    refuses speculative methods with a clear message. A module with *some* tensors missing is a
    broken checkpoint and fails with the missing names.
    """
    present = 0
    for i in range(cfg.num_nextn_predict_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + i}."
        if not any(name.startswith(prefix) for name in files):
            break
        present += 1
    if present == cfg.num_nextn_predict_layers:
        return cfg
    return dataclasses.replace(
        cfg, num_nextn_predict_layers=present, declared_mtp_modules=cfg.num_nextn_predict_layers
    )


def _fused_expert_tensors(name: str) -> bool:
    return name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj")


def load_model(
    folder: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    cfg: ModelConfig | None = None,
) -> DeepseekV3ForCausalLM:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    cfg = cfg or ModelConfig.from_folder(folder)
    torch_dtype = parse_dtype(dtype)
    files = checkpoint_files(folder)
    cfg = _present_mtp_modules(cfg, files)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    model.to_empty(device=device)
    # Norms stay in `dtype` like the rest; the router stays float32 as the reference keeps it.
    model.to(torch_dtype)
    for module in model.modules():
        if isinstance(module, TopkRouter):
            module.float()
    model.rope = RotaryEmbedding(cfg).to(device)  # non-persistent buffers: rebuild off meta

    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded: set[str] = set()
    handles: dict[Path, object] = {}
    try:
        for name, path in sorted(files.items()):
            if _skip(name, cfg):
                continue
            if path not in handles:
                handles[path] = safe_open(str(path), "pt", device="cpu")
            handle = handles[path]
            if _fused_expert_tensors(name) and name not in expected:
                loaded |= _load_fused_experts(name, handle.get_tensor(name), expected)  # type: ignore[attr-defined]
                continue
            if name not in expected:
                continue  # unrelated extras (e.g. rotary buffers) are ignored
            tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
            target = expected[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
    finally:
        handles.clear()
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint in {folder} is missing tensors: {shown}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model


def _load_fused_experts(
    name: str, tensor: torch.Tensor, expected: dict[str, torch.Tensor]
) -> set[str]:
    """Split transformers' fused [E, 2I, H] gate_up / [E, H, I] down tensors per expert."""
    prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
    done: set[str] = set()
    for e in range(tensor.shape[0]):
        if name.endswith("gate_up_proj"):
            gate, up = tensor[e].chunk(2, dim=0)
            parts = {"gate_proj": gate, "up_proj": up}
        else:
            parts = {"down_proj": tensor[e]}
        for proj, value in parts.items():
            key = f"{prefix}.{e}.{proj}.weight"
            if key not in expected or tuple(expected[key].shape) != tuple(value.shape):
                raise CheckpointError(f"fused expert tensor {name} does not match expert {e} of the config")
            with torch.no_grad():
                expected[key].copy_(value)
            done.add(key)
    return done
