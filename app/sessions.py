"""Registry of open sessions: who owns them, when they expire, whether a turn is running.

The engine holds a session's tokens and KV blocks; this registry holds what the HTTP layer needs
to authorise and expire them. Ids come from ``secrets.token_urlsafe`` (192 bits). A session that
is closed, expired or owned by another tenant is indistinguishable from one that never existed.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class SessionRecord:
    id: str
    tenant: str
    created_at: float  # unix seconds
    last_used: float  # unix seconds
    idle_timeout_s: float
    num_tokens: int = 0
    busy: bool = False

    @property
    def expires_at(self) -> float:
        return self.last_used + self.idle_timeout_s

    def public(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "session",
            "created_at": int(self.created_at),
            "expires_at": int(self.expires_at),
            "num_tokens": self.num_tokens,
            "busy": self.busy,
        }


class SessionRegistry:
    def __init__(self, idle_timeout_s: float, clock: Callable[[], float] = time.time) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._sessions: dict[str, SessionRecord] = {}

    def new(self, tenant: str) -> SessionRecord:
        """A record not yet registered (the engine opens it first, then :meth:`add`)."""
        now = self._clock()
        return SessionRecord(secrets.token_urlsafe(24), tenant, now, now, self.idle_timeout_s)

    def add(self, record: SessionRecord) -> None:
        self._sessions[record.id] = record

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        record = self._sessions.get(session_id)
        if record is None or not secrets.compare_digest(record.tenant, tenant):
            return None
        if not record.busy and record.expires_at <= self._clock():
            return None
        return record

    def pop(self, session_id: str) -> SessionRecord | None:
        return self._sessions.pop(session_id, None)

    def touch(self, record: SessionRecord) -> None:
        record.last_used = self._clock()

    def count(self, tenant: str) -> int:
        return sum(1 for r in self._sessions.values() if r.tenant == tenant)

    def idle_tokens(self, tenant: str) -> int:
        return sum(
            r.num_tokens for r in self._sessions.values() if r.tenant == tenant and not r.busy
        )

    def expired(self) -> list[SessionRecord]:
        now = self._clock()
        return [r for r in self._sessions.values() if not r.busy and r.expires_at <= now]

    def all(self) -> list[SessionRecord]:
        return list(self._sessions.values())

    def counts_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self._sessions.values():
            counts[record.tenant] = counts.get(record.tenant, 0) + 1
        return counts
