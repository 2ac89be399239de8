"""Dependencies shared by the routes (``Annotated`` aliases, as in full-stack-fastapi-template)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.errors import APIError, not_found
from app.service import Service
from app.sessions import SessionRecord
from app.tenants import Tenant

_bearer = HTTPBearer(auto_error=False, description="The tenant's API key.")


def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]


def get_tenant(
    service: ServiceDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Tenant:
    if credentials is None or not credentials.credentials:
        raise APIError(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    tenant = service.tenants.authenticate(credentials.credentials)
    if tenant is None:
        raise APIError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]


def get_ready_service(service: ServiceDep, _tenant: TenantDep) -> Service:
    """The service, after authentication, if it takes new work (503 while loading/draining)."""
    service.require_ready()
    return service


ReadyServiceDep = Annotated[Service, Depends(get_ready_service)]


def get_session(session_id: str, service: ServiceDep, tenant: TenantDep) -> SessionRecord:
    """The caller's own open session; any other id (foreign, closed, expired) is a 404."""
    record = service.sessions.get(tenant.name, session_id)
    if record is None:
        raise not_found("No such session.", "session_not_found")
    return record


SessionDep = Annotated[SessionRecord, Depends(get_session)]


def check_model(service: Service, model: str | None) -> None:
    if model is None or model in (service.model_name, str(service.settings.model)):
        return
    error = not_found("The model does not exist.", "model_not_found")
    error.param = "model"
    raise error
