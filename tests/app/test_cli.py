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


def test_the_adaptive_chain_arms_are_set_by_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--spec-chain-depths 4,6`` and ``MTPSERVE_SPEC_CHAIN_DEPTHS=[4,6]`` reach the engine's
    ``SpecConfig.chain_depths``; a malformed list is a usage error."""
    from app.main import engine_factory_from_settings
    from app.server import settings_from_argv
    from engine.params import SpecConfig

    assert settings_from_argv(["--spec-chain-depths", "4,6"]).spec_chain_depths == (4, 6)
    monkeypatch.setenv("MTPSERVE_SPEC_CHAIN_DEPTHS", "[3,5]")
    assert settings_from_argv([]).spec_chain_depths == (3, 5)
    with pytest.raises(SystemExit):
        settings_from_argv(["--spec-chain-depths", "4,x"])
    seen: list[SpecConfig] = []
    monkeypatch.setattr("engine.llm_engine.LLMEngine.from_pretrained",
                        lambda *a, spec, **k: seen.append(spec))  # fmt: skip
    engine_factory_from_settings(settings_from_argv(["--spec-method", "adaptive"]))()
    assert seen[-1].chain_depths == (3, 5)
