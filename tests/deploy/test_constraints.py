"""deploy/constraints.txt pins exactly the run-time dependencies the tests run with.

The image installs with these pins, so a passing test suite speaks for the image. After a change
to pyproject.toml or the virtual environment, regenerate the pins with
    .venv/bin/python -m tests.deploy.test_constraints > deploy/constraints.txt
"""

from __future__ import annotations

import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.conftest import DEPLOY, REPO

HEADER = """\
# Exact versions of mtpserve's run-time dependencies (the closure of [project.dependencies] in
# pyproject.toml) as installed where the tests pass. The Dockerfile installs with
# `pip install -c deploy/constraints.txt`, so an image built later gets the same versions.
# torch carries no local tag (+cpu/+cu128): one pin matches the CPU and the CUDA wheel, and the
# CUDA wheel pins its own nvidia-* and triton packages.
# Regenerate: .venv/bin/python -m tests.deploy.test_constraints > deploy/constraints.txt
"""


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def installed_closure() -> dict[str, str]:
    """name -> installed version for the dependencies and everything they need (no extras)."""
    versions: dict[str, str] = {}
    todo = _project_requirements()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in versions or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        dist = metadata.distribution(req.name)
        versions[name] = dist.version.split("+")[0]  # drop the local tag (+cpu)
        todo.extend(Requirement(r) for r in dist.requires or [])
    return versions


def pinned() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_pins_match_the_tested_environment() -> None:
    assert pinned() == installed_closure()


def test_pins_satisfy_pyproject() -> None:
    pins = pinned()
    for req in _project_requirements():
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), str(req)


if __name__ == "__main__":
    print(HEADER, end="")
    for name, version in sorted(installed_closure().items()):
        print(f"{name}=={version}")
