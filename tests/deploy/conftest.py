"""Shared paths and loaders for the deployment checks (tests/deploy/)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARDS_DIR = DEPLOY / "grafana" / "dashboards"
# In CI the repository is cloned with shared/ beside it.
COMPOSE_SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"

# ${VAR:-default} / ${VAR-default} / ${VAR}: what Compose substitutes from the environment.
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def with_defaults(value: Any) -> str:
    """The string Compose produces when no variable is set: every ${VAR:-x} becomes x."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


def require_tool(name: str) -> str:
    """The tool's path; fail (never skip): `make test` installs it through `make system-deps`."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not installed: run `make system-deps` (Debian package prometheus)"
        )
    return path


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def _walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _walk_panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) for every query target of every shipped dashboard."""
    found = []
    for path in dashboard_files():
        dash = json.loads(path.read_text())
        for panel in _walk_panels(dash["panels"]):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((path.name, panel["title"], target["expr"]))
    return found


def rule_exprs() -> list[tuple[str, str]]:
    """(rule name, PromQL) for every rule in the rule files that prometheus.yml loads."""
    found = []
    for name in load_yaml(PROMETHEUS_DIR / "prometheus.yml")["rule_files"]:
        doc = load_yaml(PROMETHEUS_DIR / name)  # relative to the config file, as Prometheus does
        for group in doc["groups"]:
            for rule in group["rules"]:
                found.append((rule.get("alert") or rule["record"], rule["expr"]))
    return found


# Grafana's macros and the dashboards' variables, replaced by what Grafana would send, so the
# expressions can go to Prometheus as they are. An unknown `$name` stays and fails the parse check.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "$tenant": ".*",
}


def as_promql(expr: str) -> str:
    for macro, value in GRAFANA_SUBSTITUTIONS.items():
        expr = expr.replace(macro, value)
    return expr
