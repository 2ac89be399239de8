"""``GET /v1/models`` and ``GET /v1/models/{model_id}``."""

from fastapi import APIRouter

from app.api.deps import ServiceDep, TenantDep, check_model
from app.api.routes.responses_doc import ERRORS
from app.schemas import ModelCard, ModelList
from app.service import Service

router = APIRouter(prefix="/v1", tags=["models"])


def _card(service: Service) -> ModelCard:
    max_len = service.engine.max_model_len if service.loop.ready else None
    return ModelCard(id=service.model_name, created=int(service.started_at), max_model_len=max_len)


@router.get("/models", response_model=ModelList, responses=ERRORS)
async def list_models(service: ServiceDep, _tenant: TenantDep) -> ModelList:
    return ModelList(data=[_card(service)])


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
async def get_model(model_id: str, service: ServiceDep, _tenant: TenantDep) -> ModelCard:
    check_model(service, model_id)
    return _card(service)
