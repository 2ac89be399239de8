"""The compose files: valid Compose Specification, and the controls the deployment promises.

No Docker engine runs here, so the files are checked as data: against the specification's JSON
schema (Debian's docker-compose 1.29 is older than the specification and would reject valid
files), then property by property against what docs/deploy.md tells operators.
"""

from __future__ import annotations

import json
import re
import tomllib

import jsonschema
import pytest

from tests.deploy.conftest import COMPOSE_SCHEMA, PROMETHEUS_DIR, REPO, load_yaml, with_defaults

COMPOSE = load_yaml(REPO / "docker-compose.yml")
GPU = load_yaml(REPO / "compose.gpu.yml")
SERVICES = COMPOSE["services"]
MTP = SERVICES["mtpserve"]


def _flag(service: dict, name: str) -> str:
    """The value of `--name=value` in a service's command."""
    for arg in service["command"]:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"--{name} missing from {service['command']}")


API_PORT = int(_flag(MTP, "port"))
METRICS_PORT = int(_flag(MTP, "metrics-port"))


@pytest.mark.parametrize("name", ["docker-compose.yml", "compose.gpu.yml"])
def test_valid_against_compose_specification(name: str) -> None:
    assert COMPOSE_SCHEMA.is_file(), f"{COMPOSE_SCHEMA} missing: clone shared/ beside the repo"
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    # The file names draft 7 by a URL jsonschema does not recognise (no trailing "#").
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(load_yaml(REPO / name))
    ]
    assert errors == []


@pytest.mark.parametrize("doc", [COMPOSE, GPU], ids=["docker-compose.yml", "compose.gpu.yml"])
def test_images_are_pinned(doc: dict) -> None:
    for name, service in doc["services"].items():
        image = with_defaults(service["image"])
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: {image} is not a version"


def test_mtpserve_image_tag_is_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert MTP["image"] == f"mtpserve:{version}"
    assert GPU["services"]["mtpserve"]["image"].startswith(f"mtpserve:{version}-")


def test_every_service_has_healthcheck_and_restart_policy() -> None:
    assert set(SERVICES) == {"mtpserve", "prometheus", "grafana"}
    for name, service in SERVICES.items():
        assert service["restart"] in {"always", "unless-stopped", "on-failure"}, name
        test = service["healthcheck"]["test"]
        assert test[0] in {"CMD", "CMD-SHELL"} and len(test) > 1, name
    # mtpserve is healthy when ready to serve, not merely alive.
    assert f"127.0.0.1:{API_PORT}/ready" in " ".join(MTP["healthcheck"]["test"])


def test_model_service_has_no_egress() -> None:
    networks = COMPOSE["networks"]
    no_nat = "com.docker.network.bridge.enable_ip_masquerade"
    for name in MTP["networks"]:
        net = networks[name]
        # internal: no route out at all. A network that carries a published port cannot be
        # internal (Docker publishes nothing there), so it must at least not masquerade.
        assert net.get("internal") is True or net["driver_opts"][no_nat] == "false", name
    assert any(networks[n].get("internal") is True for n in MTP["networks"])


def _published(service: dict) -> list[dict]:
    ports = service.get("ports", [])
    assert all(isinstance(p, dict) for p in ports), "use the long port syntax"
    return ports


def test_only_the_api_port_is_published() -> None:
    ports = _published(MTP)
    assert [p["target"] for p in ports] == [API_PORT]
    assert _published(SERVICES["prometheus"]) == []
    for name, service in SERVICES.items():
        for port in _published(service):
            assert port["target"] != METRICS_PORT, f"{name} publishes the metrics port"
            if name != "mtpserve":  # operator UIs: host loopback unless the operator opens them
                assert with_defaults(port["host_ip"]) == "127.0.0.1", name


def test_metrics_port_is_reachable_by_prometheus_alone() -> None:
    networks = COMPOSE["networks"]
    icc_off = "com.docker.network.bridge.enable_icc"
    peers = {
        name
        for name, service in SERVICES.items()
        if name != "mtpserve"
        for net in service.get("networks", [])
        if net in MTP["networks"] and networks[net].get("driver_opts", {}).get(icc_off) != "false"
    }
    assert peers == {"prometheus"}
    scrape = load_yaml(PROMETHEUS_DIR / "prometheus.yml")["scrape_configs"]
    job = next(j for j in scrape if j["job_name"] == "mtpserve")
    assert job["static_configs"][0]["targets"] == [f"mtpserve:{METRICS_PORT}"]


def _mount(service: dict, target: str) -> dict:
    found = [v for v in service["volumes"] if isinstance(v, dict) and v["target"] == target]
    assert len(found) == 1, f"no single long-syntax mount at {target}"
    return found[0]


def test_tenants_file_and_model_folder_are_mounted_read_only() -> None:
    for target in (_flag(MTP, "tenants"), MTP["environment"]["MTPSERVE_MODEL"]):
        mount = _mount(MTP, target)
        assert mount["type"] == "bind" and mount["read_only"] is True, target
        # A missing host file must stop `up`, not become an empty directory.
        assert mount["bind"]["create_host_path"] is False, target
    # Every configuration bind mount, in every service, is read-only.
    for name, service in SERVICES.items():
        for mount in service.get("volumes", []):
            if mount["type"] == "bind":
                assert mount["read_only"] is True, f"{name}: {mount['target']}"


def test_read_only_root_filesystem_with_tmpfs_and_cache_volume() -> None:
    for name, service in SERVICES.items():
        assert service["read_only"] is True, name
        assert str(service["user"]).split(":")[0] not in {"0", "root"}, name
        assert "ALL" in service["cap_drop"], name
        assert "no-new-privileges:true" in service["security_opt"], name
    assert any(t.split(":")[0] == "/tmp" for t in MTP["tmpfs"])
    assert MTP["ulimits"]["core"] == 0  # a core dump would put tenants' data on disk
    cache = _mount(MTP, "/var/cache/mtpserve")
    assert cache["type"] == "volume" and cache["source"] in COMPOSE["volumes"]


_SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|API_?KEY|CREDENTIAL", re.IGNORECASE)


def test_no_hard_coded_secrets() -> None:
    for service in SERVICES.values():
        for key, value in service.get("environment", {}).items():
            if _SECRET_NAME.search(key):
                # Only a path to a mounted secret file may be written here.
                assert key.endswith("__FILE") and str(value).startswith("/run/secrets/"), key
    for name, secret in COMPOSE["secrets"].items():
        assert set(secret) <= {"environment", "file", "external", "name"}, name
    grafana = SERVICES["grafana"]
    path = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert path.removeprefix("/run/secrets/") in grafana["secrets"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["environment"]["GF_USERS_ALLOW_SIGN_UP"] == "false"


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration))


def test_graceful_stop_has_time_to_drain() -> None:
    assert MTP["stop_signal"] == "SIGTERM"
    assert MTP["init"] is True  # PID 1 that forwards the signal
    drain = float(MTP["environment"]["MTPSERVE_DRAIN_TIMEOUT_S"])
    assert _seconds(MTP["stop_grace_period"]) >= drain + 15  # time to abort, zero and exit


def test_gpu_override_reserves_nvidia_gpus() -> None:
    service = GPU["services"]["mtpserve"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    device = devices[0]
    assert device["driver"] == "nvidia"
    count = with_defaults(device["count"])
    assert count == "all" or int(count) >= 1
    assert "gpu" in device["capabilities"]
    # The CPU image cannot use the GPUs it is given: the override must build the CUDA variant.
    assert service["build"]["args"]["TORCH_VARIANT"].startswith("cu")
    assert service["environment"]["MTPSERVE_DEVICE"] == "cuda"


def test_example_tenants_file_is_valid_and_admits_nobody() -> None:
    from app.tenants import load_tenants_file

    tenants = load_tenants_file(REPO / "deploy" / "tenants.example.toml")
    assert tenants
    # Placeholder hashes: far below 2**16, so no real key's SHA-256 is among them.
    assert all(int(t.api_key_sha256, 16) < 2**16 for t in tenants.values())
