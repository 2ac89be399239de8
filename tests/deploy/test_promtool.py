"""promtool on the shipped Prometheus files: config syntax, rule syntax, and rule behaviour.

Fails (does not skip) without promtool: `make test` installs it (`make system-deps`).
"""

from __future__ import annotations

import subprocess

from tests.deploy.conftest import PROMETHEUS_DIR, require_tool


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    # Run from deploy/prometheus so relative rule_files resolve as they do in the container.
    return subprocess.run(
        [require_tool("promtool"), *args],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_syntax() -> None:
    result = _promtool("check", "config", "--syntax-only", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_syntax() -> None:
    result = _promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    # Every alert the deployment issue asks for is defined.
    assert "SUCCESS: 9 rules found" in result.stdout


def test_alert_rules_fire_when_they_should_and_only_then() -> None:
    # alerts.test.yml feeds synthetic series: e.g. KV at 96% fires, at 90% does not.
    result = _promtool("test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
