"""``/health`` (liveness) and ``/ready`` (model loaded, engine thread alive, not draining).

Neither needs an API key.
"""

from fastapi import APIRouter

from app.api.deps import ServiceDep
from app.api.routes.responses_doc import ERRORS

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", responses={503: ERRORS[503]})
async def ready(service: ServiceDep) -> dict[str, str]:
    service.require_ready()
    return {"status": "ready"}
