"""``mtpserve`` dispatches lazily and explains missing commands."""

from __future__ import annotations

import sys
import types

import pytest

from engine import cli


def test_dispatch_passes_remaining_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("bench.cli")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench.cli", fake)
    assert cli.main(["bench", "--x", "1", "pos"]) == 0
    assert seen == [["--x", "1", "pos"]]


def test_missing_command_module_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "train", ("train.no_such_module_here", "x"))
    assert cli.main(["train"]) == 2
    assert "not available" in capsys.readouterr().err


def test_unknown_command_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2


def test_serve_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--port", "99999"]) == 2
    assert "port" in capsys.readouterr().err
