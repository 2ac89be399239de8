"""The metrics port: ``/metrics`` (Prometheus text) and ``/admin/acceptance`` (JSON).

A separate ASGI app served by a second uvicorn server, so ``/metrics`` never exists on the API
port. ``/admin/acceptance`` returns ``engine.acceptance_snapshot()`` (read on the engine thread)
for the acceptance simulator.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import error_body
from app.service import Service
from engine.serving import LoopClosed


def build_metrics_app(service: Service) -> Starlette:
    async def metrics(_request: Request) -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def acceptance(_request: Request) -> Response:
        try:
            snapshot: Any = await service.loop.call(lambda eng: eng.acceptance_snapshot())
        except LoopClosed:
            return JSONResponse(error_body(503, "the model is not loaded", code="not_ready"), 503)
        return JSONResponse(snapshot)

    async def not_found(_request: Request, _exc: Exception) -> Response:
        return JSONResponse(error_body(404, "Not found."), 404)

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/admin/acceptance", acceptance)],
        exception_handlers={404: not_found},
    )
