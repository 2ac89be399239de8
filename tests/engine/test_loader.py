"""Broken checkpoints get precise errors; sharded folders load like single files."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLMEngine, SamplingParams, SpecConfig
from engine.model.loader import CheckpointError, load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shard(folder: Path) -> None:
    """Split model.safetensors into two shards with an index, as HF does for large models."""
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_folder_gives_the_same_tokens(dense_model_dir: Path, tmp_path: Path) -> None:
    sharded = _copy(dense_model_dir, tmp_path / "sharded")
    _shard(sharded)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    a = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="tree")).generate([[3, 4, 5]], sp)
    b = LLMEngine.from_pretrained(sharded, spec=SpecConfig(method="tree")).generate([[3, 4, 5]], sp)
    assert a[0].token_ids == b[0].token_ids


@contextlib.contextmanager
def _tensors(folder: Path) -> Iterator[dict[str, torch.Tensor]]:
    """Edit the tensors of a single-file checkpoint in place."""
    tensors = load_file(str(folder / "model.safetensors"))
    yield tensors
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_tensor_is_named(dense_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(dense_model_dir, tmp_path / "missing")
    with _tensors(folder) as tensors:
        del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(folder)


def test_wrong_shape_is_reported(dense_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(dense_model_dir, tmp_path / "shape")
    with _tensors(folder) as tensors:
        tensors["model.norm.weight"] = torch.ones(7)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(7,\), expected \(64,\)"):
        load_model(folder)


def test_missing_shard_is_named(dense_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(dense_model_dir, tmp_path / "noshard")
    _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors"):
        load_model(folder)


def test_partial_mtp_layer_is_named(dense_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(dense_model_dir, tmp_path / "partialmtp")
    with _tensors(folder) as tensors:
        del tensors["model.layers.3.eh_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight"):
        load_model(folder)


def test_checkpoint_without_mtp_weights_serves_autoregressively(
    dense_model_dir: Path, tmp_path: Path
) -> None:
    """What transformers' save_pretrained writes: num_nextn_predict_layers set, no MTP tensors."""
    folder = _copy(dense_model_dir, tmp_path / "nomtp")
    with _tensors(folder) as tensors:
        for name in [k for k in tensors if k.startswith(("model.layers.2.", "model.layers.3."))]:
            del tensors[name]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="none")).generate([[3, 4]], sp)
    got = LLMEngine.from_pretrained(folder, spec=SpecConfig(method="none")).generate([[3, 4]], sp)
    assert got[0].token_ids == want[0].token_ids
    with pytest.raises(ValueError, match=r"declares num_nextn_predict_layers = 2.*model\.layers\.2"):
        LLMEngine.from_pretrained(folder, spec=SpecConfig(method="tree"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"kv_lora_rank": None}, "missing required keys: kv_lora_rank"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "unsupported rope type"),
    ],
)
def test_bad_config_is_reported(dense_model_dir: Path, tmp_path: Path, edit: dict, message: str) -> None:  # type: ignore[type-arg]
    folder = _copy(dense_model_dir, tmp_path / "cfg")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_no_weights_at_all(dense_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(dense_model_dir / "config.json", folder / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(folder)


def test_engine_rejects_bad_requests(dense_model_dir: Path) -> None:
    eng = LLMEngine.from_pretrained(dense_model_dir, spec=SpecConfig(method="none"))
    for bad in ([1, 10_000], [1, -1], [1, True], [1, 2.0], [1, "2"], [None]):
        with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, "):
            eng.add_request("a", bad, SamplingParams())  # type: ignore[arg-type]
    assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        eng.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        eng.add_request("c", [1, 2], SamplingParams(max_tokens=100_000))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="method"):
        SpecConfig(method="medusa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device"):
        LLMEngine.from_pretrained(dense_model_dir, device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine.from_pretrained(dense_model_dir, dtype="float8")
    assert not eng.has_unfinished_requests()
