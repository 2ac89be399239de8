"""The Dockerfile and .dockerignore, read as text (no Docker engine here to build them)."""

from __future__ import annotations

import re
import tomllib

from tests.deploy.conftest import REPO, load_yaml

DOCKERFILE = (REPO / "Dockerfile").read_text()
# Continuation lines joined, so each instruction is one line.
INSTRUCTIONS = [
    line.strip()
    for line in DOCKERFILE.replace("\\\n", " ").splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]
RUN_STAGE = INSTRUCTIONS[max(i for i, x in enumerate(INSTRUCTIONS) if x.startswith("FROM")) :]
COMPOSE_MTP = load_yaml(REPO / "docker-compose.yml")["services"]["mtpserve"]


def _args(keyword: str, lines: list[str] = INSTRUCTIONS) -> list[str]:
    return [x.split(None, 1)[1] for x in lines if x.split(None, 1)[0] == keyword]


def test_multi_stage_cpu_by_default_cuda_by_argument() -> None:
    assert len(_args("FROM")) >= 2
    assert "TORCH_VARIANT=cpu" in _args("ARG")
    # The torch wheel comes from the index of the chosen variant.
    assert any("${TORCH_VARIANT}" in a for a in _args("ARG"))


def test_dependencies_come_from_the_project_files_with_pins() -> None:
    installs = [r for r in _args("RUN") if "pip install" in r]
    assert installs and all("-c /tmp/constraints.txt" in r for r in installs)
    assert "deploy/constraints.txt /tmp/constraints.txt" in _args("COPY")
    assert any(r.rstrip().endswith("/src") for r in installs)  # the package from pyproject.toml


def test_runs_as_non_root_with_offline_caches() -> None:
    user = _args("USER", RUN_STAGE)
    assert user and user[-1].split(":")[0] not in {"0", "root"}
    env = " ".join(_args("ENV", RUN_STAGE))
    for setting in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "PYTHONDONTWRITEBYTECODE=1"):
        assert setting in env
    # Every cache lives under the one writable volume that compose mounts.
    for cache in re.findall(r"(?:HOME|CACHE_DIR)=(\S+)", env):
        assert cache.startswith("/var/cache/mtpserve"), cache
    assert '["/var/cache/mtpserve"]' in _args("VOLUME", RUN_STAGE)


def test_ships_the_demo_model_and_lets_a_mount_replace_it() -> None:
    assert any(c.startswith("models/demo ") for c in _args("COPY", RUN_STAGE))
    assert "MTPSERVE_MODEL=/opt/mtpserve/models/demo" in " ".join(_args("ENV", RUN_STAGE))
    assert COMPOSE_MTP["environment"]["MTPSERVE_MODEL"] != "/opt/mtpserve/models/demo"


def _cmd_flag(flag: str) -> str:
    match = re.search(rf'"--{flag}", "(\d+)"', " ".join(_args("CMD", RUN_STAGE)))
    assert match, f"{flag} missing from CMD"
    return match.group(1)


def test_ports_healthcheck_and_stop_signal_match_compose() -> None:
    port, metrics = _cmd_flag("port"), _cmd_flag("metrics-port")
    assert _args("EXPOSE", RUN_STAGE) == [f"{port} {metrics}"]
    assert f"--port={port}" in COMPOSE_MTP["command"]
    assert f"--metrics-port={metrics}" in COMPOSE_MTP["command"]
    healthcheck = " ".join(_args("HEALTHCHECK", RUN_STAGE))
    assert f"127.0.0.1:{port}/ready" in healthcheck
    assert _args("STOPSIGNAL", RUN_STAGE) == ["SIGTERM"]


def test_entrypoint_is_the_packaged_cli() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert _args("ENTRYPOINT", RUN_STAGE) == ['["mtpserve"]'] and "mtpserve" in scripts


def test_dockerignore_keeps_secrets_and_local_state_out() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for path in (".git", ".venv", "deploy/tenants.toml", ".env", "models/*"):
        assert path in ignored, path
    assert "!models/demo" in ignored
