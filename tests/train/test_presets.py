"""Preset overrides from the command line (``mtpserve train --set NAME=VALUE``)."""

from __future__ import annotations

import pytest

from train.cli import parse_args
from train.presets import get_preset, parse_override


def test_overrides_are_typed_as_the_preset_field() -> None:
    assert parse_override("num_mtp_modules=6") == ("num_mtp_modules", 6)
    assert parse_override("distill_frac=0.35") == ("distill_frac", 0.35)
    assert parse_override("q_lora_rank=none") == ("q_lora_rank", None)
    assert parse_override("compile_joint=false") == ("compile_joint", False)
    assert parse_override("export_dtype=float16") == ("export_dtype", "float16")
    preset = get_preset("gpu", **dict([parse_override("num_hidden_layers=20")]))
    assert preset.num_hidden_layers == 20 and preset.hidden_size == get_preset("gpu").hidden_size


@pytest.mark.parametrize("spec, message", [
    ("hidden=768", "NAME one of"),  # no such field
    ("num_mtp_modules", "NAME one of"),  # no value
    ("name=x", "NAME one of"),  # the preset's name is not a setting
    ("num_mtp_modules=six", "is not a int"),
    ("compile_joint=maybe", "is not a bool"),
    ("vocab_size=none", "is not a int"),  # None only where the field is optional
])  # fmt: skip
def test_bad_overrides_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_override(spec)


def test_cli_collects_overrides_and_rejects_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--preset", "tiny", "--out", "x", "--set", "num_mtp_modules=2", "--set", "lr=0.01"])
    assert args.overrides == {"num_mtp_modules": 2, "lr": 0.01}
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--set", "lr=fast"])
    assert "--set lr: 'fast' is not a float" in capsys.readouterr().err
