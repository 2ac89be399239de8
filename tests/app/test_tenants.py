"""Tenants file: parsing, hashed keys, reload on SIGHUP keeps the old table on errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.tenants import TenantConfigError, TenantRegistry, hash_key


def _write(path: Path, entries: dict[str, str]) -> None:
    lines = []
    for name, key in entries.items():
        lines += [f"[tenants.{name}]", f'api_key_sha256 = "{hash_key(key)}"', ""]
    path.write_text("\n".join(lines))


def test_load_authenticate_and_reload(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    _write(path, {"acme": "key-acme", "globex": "key-globex"})
    registry = TenantRegistry.from_file(path)
    assert registry.authenticate("key-acme").name == "acme"  # type: ignore[union-attr]
    assert registry.authenticate("key-globex").name == "globex"  # type: ignore[union-attr]
    assert registry.authenticate("key-nobody") is None
    assert "key-acme" not in path.read_text()  # only hashes are stored

    _write(path, {"acme": "new-acme-key"})
    assert registry.reload()
    assert registry.authenticate("key-acme") is None
    assert registry.authenticate("new-acme-key").name == "acme"  # type: ignore[union-attr]

    path.write_text("[tenants.acme]\napi_key_sha256 = 'not-hex'\n")
    assert not registry.reload()  # invalid file: the current table stays
    assert registry.authenticate("new-acme-key") is not None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[tenants.a]\napi_key_sha256 = 'zz'\n",
        f"[tenants.a]\napi_key_sha256 = '{'a' * 64}'\nmax_sessions = -1\n",
        f"[tenants.a]\napi_key_sha256 = '{'a' * 64}'\nunknown = 1\n",
        f"[tenants.a]\napi_key_sha256 = '{'a' * 64}'\n[tenants.b]\napi_key_sha256 = '{'a' * 64}'\n",
        "not toml ===",
    ],
)
def test_invalid_files_are_rejected(tmp_path: Path, text: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TenantConfigError):
        TenantRegistry.from_file(path)


def test_quotas_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        f"[tenants.a]\napi_key_sha256 = '{hash_key('k')}'\nmax_concurrent_requests = 3\n"
        "tokens_per_minute = 1000\n"
    )
    tenant = TenantRegistry.from_file(path).authenticate("k")
    assert tenant is not None
    assert tenant.max_concurrent_requests == 3 and tenant.tokens_per_minute == 1000
    assert tenant.max_sessions is None
