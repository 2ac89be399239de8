"""The app factory: wires settings, tenants, metrics, the engine loop and the routers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app.api.routes import chat, completions, health, models, sessions
from app.body_limit import BodyLimitMiddleware
from app.errors import install_error_handlers
from app.metrics import Metrics, MetricsObserver
from app.quotas import QuotaManager
from app.service import Service
from app.sessions import SessionRegistry
from app.settings import Settings
from app.tenants import TenantRegistry
from engine.serving import EngineLoop

EngineFactory = Callable[[], Any]


def engine_factory_from_settings(settings: Settings) -> EngineFactory:
    """Builds the real ``LLMEngine`` (imported lazily: torch is heavy)."""

    def build() -> Any:
        from engine.llm_engine import LLMEngine
        from engine.params import EngineConfig, SpecConfig

        spec = SpecConfig(
            method=settings.spec_method,
            topk=settings.spec_topk,
            depth=settings.spec_depth,
            num_draft_tokens=settings.spec_num_draft_tokens,
            chain_depths=settings.spec_chain_depths,
        )
        kv_bytes = settings.kv_memory_mb * 1024 * 1024 if settings.kv_memory_mb else None
        config = EngineConfig(
            max_batch_size=settings.max_batch,
            kv_memory_bytes=kv_bytes,
            block_size=settings.block_size,
            max_model_len=settings.max_model_len,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            overlap_steps=settings.overlap_steps,
            drafting_layer=settings.drafting_layer,
        )
        return LLMEngine.from_pretrained(
            str(settings.model), device=settings.device, dtype=settings.dtype, spec=spec,
            engine_config=config,
        )  # fmt: skip

    return build


def build_service(
    settings: Settings,
    tenants: TenantRegistry,
    engine_factory: EngineFactory,
    freeze_gc: bool = False,
) -> Service:
    metrics = Metrics()
    loop = EngineLoop(
        engine_factory,
        max_waiting=settings.max_waiting,
        max_running=settings.max_batch,
        observer=MetricsObserver(metrics),
        freeze_gc=freeze_gc,
    )
    return Service(
        settings=settings,
        tenants=tenants,
        metrics=metrics,
        loop=loop,
        quotas=QuotaManager(),
        sessions=SessionRegistry(settings.session_idle_timeout_s),
    )


def create_app(
    settings: Settings,
    tenants: TenantRegistry,
    engine_factory: EngineFactory | None = None,
    service: Service | None = None,
    freeze_gc: bool = False,
) -> FastAPI:
    """The API app. The engine is built on the engine thread when the app starts (lifespan);
    ``/ready`` answers 503 until it is loaded. ``freeze_gc``: the process serves this app only
    (``app.server``), so what exists once the engine is loaded can leave the cyclic GC."""
    if service is None:
        factory = engine_factory or engine_factory_from_settings(settings)
        service = build_service(settings, tenants, factory, freeze_gc)
    svc = service

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        svc.start()
        try:
            yield
        finally:
            await svc.drain()
            await svc.shutdown()

    app = FastAPI(
        title="mtpserve",
        version="0.1.0",
        summary="OpenAI-compatible inference with MTP speculative decoding.",
        lifespan=lifespan,
    )
    app.state.service = svc
    install_error_handlers(app)
    for module in (health, models, completions, chat, sessions):
        app.include_router(module.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app
