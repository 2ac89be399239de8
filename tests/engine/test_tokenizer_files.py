"""engine.model.tokenizer_files: a folder's EOS ids and tokenizer, and precise errors for
broken generation settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.model.config import ModelConfig
from engine.model.loader import CheckpointError
from engine.model.tokenizer_files import eos_token_ids, load_tokenizer
from tests.model_factory import make_config

CFG = ModelConfig.from_hf_dict(make_config(eos_token_id=1, model_type="deepseek_v3"))


def test_generation_config_names_the_eos_ids_first(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, CFG) == {1}  # no generation_config.json: config.json's
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert eos_token_ids(tmp_path, CFG) == {7}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert eos_token_ids(tmp_path, CFG) == {7, 9}
    (tmp_path / "generation_config.json").write_text('{"max_length": 20}')
    assert eos_token_ids(tmp_path, CFG) == {1}
    assert eos_token_ids(tmp_path, dataclasses.replace(CFG, eos_token_id=None)) == frozenset()
    assert eos_token_ids(tmp_path, dataclasses.replace(CFG, eos_token_id=[3, 4])) == {3, 4}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not a JSON object of generation settings"),
        ("[1, 2]", "is not a JSON object of generation settings"),
        ('{"eos_token_id": "</s>"}', "eos_token_id must be an int or a list of ints, got '</s>'"),
        ('{"eos_token_id": [1, "2"]}', r"eos_token_id must be an int or a list of ints, got \[1, '2'\]"),
        ('{"eos_token_id": true}', "eos_token_id must be an int or a list of ints, got True"),
    ],
)
def test_broken_generation_settings_are_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        eos_token_ids(tmp_path, CFG)


def test_a_folder_without_tokenizer_files_serves_token_ids_alone(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None


def test_the_shipped_demo_tokenizer_loads() -> None:
    demo = Path(__file__).resolve().parents[2] / "models" / "demo"
    tokenizer = load_tokenizer(demo)
    assert tokenizer is not None
    ids = tokenizer.encode("def f(x):\n    return x\n")  # type: ignore[attr-defined]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"  # type: ignore[attr-defined]
