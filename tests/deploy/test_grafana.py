"""Grafana provisioning and dashboards: wired to the provisioned datasource, and complete."""

from __future__ import annotations

import json
import re

from tests.deploy.conftest import (
    DEPLOY,
    REPO,
    dashboard_exprs,
    dashboard_files,
    load_yaml,
    rule_exprs,
)
from tests.design_metrics import EXPORTED_METRICS

PROVISIONING = DEPLOY / "grafana" / "provisioning"
GRAFANA = load_yaml(REPO / "docker-compose.yml")["services"]["grafana"]

# Every metric of the DESIGN.md list: the dashboards must show each one, and PromQL may name no
# other (a typo in a metric name gives an empty panel, not an error).
METRICS = EXPORTED_METRICS


def _metric_names(expr: str) -> set[str]:
    return {re.sub(r"_(bucket|count|sum)$", "", m) for m in re.findall(r"mtpserve_\w+", expr)}


def _datasource() -> dict:
    (source,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    return source


def test_datasource_has_a_fixed_uid_and_points_at_compose_prometheus() -> None:
    source = _datasource()
    assert source["uid"] and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert source["editable"] is False


def test_every_panel_uses_the_provisioned_datasource() -> None:
    uid = _datasource()["uid"]
    for path in dashboard_files():
        text = path.read_text()
        uids = set(re.findall(r'"uid":\s*"([^"]+)"', text)) - {json.loads(text)["uid"]}
        assert uids == {uid}, path.name


def test_provider_reads_the_mounted_dashboard_folder() -> None:
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "mtpserve.yml")["providers"]
    mounts = {v["source"]: v["target"] for v in GRAFANA["volumes"] if v["type"] == "bind"}
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_dashboards_show_every_exported_metric_and_no_unknown_one() -> None:
    shown = set().union(*(_metric_names(e) for _, _, e in dashboard_exprs()))
    assert shown == METRICS
    for name, expr in rule_exprs():
        assert _metric_names(expr) <= METRICS, name


def test_dashboard_covers_the_panels_operators_asked_for() -> None:
    titles = {title for _, title, _ in dashboard_exprs()}
    for wanted in (
        "Acceptance rate",
        "Acceptance by draft position",
        "Mean accepted length",
        "Tokens per second",
        "Time to first token",
        "Inter-token latency",
        "Time per output token",
        "Running and waiting requests",
        "KV cache usage",
        "Active sessions by tenant",
        "Requests by tenant",
        "KV bytes zeroed",
        "Error rates",
    ):
        assert wanted in titles, wanted
