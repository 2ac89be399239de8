"""Per-tenant quotas: concurrency, KV tokens, requests and tokens per minute.

Everything runs on the event loop thread, so no locks. A request takes a :class:`Lease` before it
is queued and gives it back when it ends; the per-minute windows are sliding 60-second windows.
KV usage of a tenant is what its in-flight requests reserved (prompt + session history +
``max_tokens``) plus the tokens its idle sessions hold.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from app.tenants import Tenant

WINDOW_S = 60.0


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


@dataclass
class _Usage:
    concurrent: int = 0
    kv_tokens: int = 0
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)


@dataclass
class Lease:
    tenant: str
    kv_tokens: int
    released: bool = False


class QuotaManager:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = defaultdict(_Usage)

    def acquire(
        self, tenant: Tenant, *, prompt_tokens: int, kv_tokens: int, idle_session_tokens: int = 0
    ) -> Lease:
        """Check every quota, then count the request. Raises QuotaExceeded (HTTP 429)."""
        now = self._clock()
        usage = self._usage[tenant.name]
        self._expire(usage, now)
        limit = tenant.max_concurrent_requests
        if limit is not None and usage.concurrent >= limit:
            raise QuotaExceeded(f"too many concurrent requests (limit {limit})", 1.0)
        limit = tenant.requests_per_minute
        if limit is not None and len(usage.requests) >= limit:
            wait = usage.requests[0] + WINDOW_S - now
            raise QuotaExceeded(f"requests per minute limit reached ({limit})", wait)
        limit = tenant.tokens_per_minute
        if limit is not None:
            used = sum(n for _, n in usage.tokens)
            if used + prompt_tokens > limit:
                if prompt_tokens > limit:
                    raise QuotaExceeded(f"prompt exceeds the tokens per minute limit ({limit})", 60)
                wait = usage.tokens[0][0] + WINDOW_S - now if usage.tokens else 1.0
                raise QuotaExceeded(f"tokens per minute limit reached ({limit})", wait)
        limit = tenant.max_kv_tokens
        if limit is not None and usage.kv_tokens + idle_session_tokens + kv_tokens > limit:
            raise QuotaExceeded(f"KV token quota exceeded (limit {limit})", 1.0)
        usage.concurrent += 1
        usage.kv_tokens += kv_tokens
        usage.requests.append(now)
        usage.tokens.append((now, prompt_tokens))
        return Lease(tenant.name, kv_tokens)

    def add_tokens(self, tenant: str, tokens: int) -> None:
        """Count generated tokens against the tenant's tokens-per-minute window."""
        if tokens > 0:
            self._usage[tenant].tokens.append((self._clock(), tokens))

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        usage = self._usage[lease.tenant]
        usage.concurrent -= 1
        usage.kv_tokens -= lease.kv_tokens

    def concurrent(self, tenant: str) -> int:
        return self._usage[tenant].concurrent

    def _expire(self, usage: _Usage, now: float) -> None:
        while usage.requests and usage.requests[0] <= now - WINDOW_S:
            usage.requests.popleft()
        while usage.tokens and usage.tokens[0][0] <= now - WINDOW_S:
            usage.tokens.popleft()
