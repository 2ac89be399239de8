"""The service's state: settings, tenants, quotas, sessions, metrics and the engine loop.

One instance lives on ``app.state.service``; routes reach it through ``api/deps.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from app.errors import unavailable
from app.metrics import Metrics
from app.quotas import QuotaManager
from app.sessions import SessionRecord, SessionRegistry
from app.settings import Settings
from app.tenants import TenantRegistry
from engine.serving import EngineLoop, LoopClosed

log = logging.getLogger("mtpserve.service")


@dataclass
class Service:
    settings: Settings
    tenants: TenantRegistry
    metrics: Metrics
    loop: EngineLoop
    quotas: QuotaManager
    sessions: SessionRegistry
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    _reaper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ engine facts
    @property
    def ready(self) -> bool:
        return self.loop.ready and not self.draining

    def require_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down", "draining")
        if not self.loop.ready:
            if self.loop.load_error is not None:
                raise unavailable("the model failed to load", "not_ready")
            if self.loop.fault is not None:
                raise unavailable("the engine failed and is restarting", "engine_failed")
            raise unavailable("the model is loading", "not_ready")

    @property
    def engine(self) -> Any:
        try:
            return self.loop.engine
        except LoopClosed:
            raise unavailable("the model is not loaded", "not_ready") from None

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    # ------------------------------------------------------------------ sessions
    async def close_session(self, record: SessionRecord) -> int:
        """Close in the engine (zeroing its KV) and forget it; returns bytes zeroed."""
        self.sessions.pop(record.id)
        self.update_session_gauge()
        try:
            zeroed = await self.loop.call(lambda eng: eng.close_session(record.id))
        except (LoopClosed, ValueError, KeyError):
            return 0
        return int(zeroed or 0)

    def update_session_gauge(self) -> None:
        self.metrics.set_sessions(self.sessions.counts_by_tenant(), self.tenants.names())

    async def reap_sessions_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.session_reap_interval_s)
            for record in self.sessions.expired():
                log.info("session expired", extra={"fields": {"tenant": record.tenant}})
                await self.close_session(record)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.loop.start()
        self._reaper = asyncio.get_running_loop().create_task(self.reap_sessions_forever())
        self.update_session_gauge()

    async def drain(self) -> None:
        """Stop taking requests (503), let running ones finish up to the drain timeout."""
        self.draining = True
        if self.loop.ready:
            aborted = await self.loop.drain(self.settings.drain_timeout_s)
            if aborted:
                log.warning("drain timeout: aborted requests", extra={"fields": {"n": aborted}})

    async def shutdown(self) -> None:
        """Close every session (zeroing its KV), then stop the engine thread."""
        self.draining = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for record in self.sessions.all():
            try:
                await self.close_session(record)
            except Exception:  # a failed engine (``EngineLoop.fault``): the others still close
                log.exception("closing a session at shutdown failed")
        await asyncio.to_thread(self.loop.stop)
