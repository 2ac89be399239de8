"""Tenants and their API keys, from a TOML file.

```toml
[tenants.acme]
api_key_sha256 = "<hex SHA-256 of the key>"   # the key itself is never stored
max_concurrent_requests = 8                     # optional quotas; absent = unlimited
max_sessions = 4
max_kv_tokens = 65536
requests_per_minute = 600
tokens_per_minute = 200000
```

Keys are hashed and compared with ``hmac.compare_digest`` against every tenant (no early exit),
so the time taken does not depend on which tenant, if any, matched. ``reload()`` swaps the whole
table at once (SIGHUP); requests in flight keep the ``Tenant`` they were admitted with.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("mtpserve.tenants")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class TenantConfigError(ValueError):
    """The tenants file is missing, unreadable or invalid."""


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key_sha256: str
    max_concurrent_requests: int | None = Field(None, ge=1)
    max_sessions: int | None = Field(None, ge=0)
    max_kv_tokens: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)

    @field_validator("api_key_sha256")
    @classmethod
    def _hex64(cls, value: str) -> str:
        value = value.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError("must be 64 hex digits (the SHA-256 of the key)")
        return value


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key_sha256: str
    max_concurrent_requests: int | None = None
    max_sessions: int | None = None
    max_kv_tokens: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def parse_tenants(data: dict[str, Any]) -> dict[str, Tenant]:
    table = data.get("tenants")
    if not isinstance(table, dict) or not table:
        raise TenantConfigError("the tenants file needs at least one [tenants.NAME] table")
    tenants: dict[str, Tenant] = {}
    seen: set[str] = set()
    for name, entry in table.items():
        if not _NAME.match(name):
            raise TenantConfigError(f"tenant name {name!r} must match {_NAME.pattern}")
        if not isinstance(entry, dict):
            raise TenantConfigError(f"[tenants.{name}] must be a table")
        try:
            parsed = _TenantEntry.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise TenantConfigError(f"[tenants.{name}] {where}: {first['msg']}") from None
        if parsed.api_key_sha256 in seen:
            raise TenantConfigError(f"[tenants.{name}] reuses another tenant's key")
        seen.add(parsed.api_key_sha256)
        tenants[name] = Tenant(name=name, **parsed.model_dump())
    return tenants


def load_tenants_file(path: Path) -> dict[str, Tenant]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TenantConfigError(f"cannot read tenants file {path}: {exc}") from None
    return parse_tenants(data)


class TenantRegistry:
    """Maps API keys to tenants; reloadable from its file."""

    def __init__(self, tenants: dict[str, Tenant], path: Path | None = None) -> None:
        self._tenants = dict(tenants)
        self.path = path

    @classmethod
    def from_file(cls, path: Path) -> TenantRegistry:
        return cls(load_tenants_file(path), path)

    @classmethod
    def development(cls, name: str = "dev") -> tuple[TenantRegistry, str]:
        """One unlimited tenant with a fresh random key; returns the registry and the key."""
        key = "sk-dev-" + secrets.token_urlsafe(24)
        return cls({name: Tenant(name=name, api_key_sha256=hash_key(key))}), key

    def reload(self) -> bool:
        """Re-read the file; keep the current table if the new one is invalid."""
        if self.path is None:
            return False
        try:
            tenants = load_tenants_file(self.path)
        except TenantConfigError as exc:
            log.error("tenants reload failed, keeping the current tenants: %s", exc)
            return False
        self._tenants = tenants
        log.info("tenants reloaded: %d tenant(s)", len(tenants))
        return True

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def authenticate(self, key: str) -> Tenant | None:
        digest = hash_key(key)
        found: Tenant | None = None
        for tenant in self._tenants.values():  # every tenant, no early exit
            if hmac.compare_digest(digest, tenant.api_key_sha256):
                found = tenant
        return found
