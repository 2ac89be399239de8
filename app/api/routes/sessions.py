"""Sessions: multi-turn conversations whose tokens and KV blocks stay in the engine.

A turn (``POST /v1/sessions/{id}/completions``) prefills only its new text. Closing a session
(``DELETE``, idle timeout, shutdown) zeroes its KV blocks before they return to the pool.
"""

from fastapi import APIRouter, Body, Request, Response

from app.api.deps import ReadyServiceDep, ServiceDep, SessionDep, TenantDep, check_model
from app.api.routes.responses_doc import ERRORS
from app.choices import Choices
from app.errors import APIError, not_found, too_many
from app.generation import GenerationInput
from app.prompts import echo_text, encode_prompt
from app.responses import completion_response
from app.sampling import build_sampling, resolve_max_tokens
from app.schemas import (
    CompletionResponse,
    SessionClosed,
    SessionCompletionRequest,
    SessionCreated,
    SessionCreateRequest,
    SessionInfo,
)
from app.service import Service
from app.sessions import SessionRecord
from engine.serving import LoopClosed

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
DEFAULT_MAX_TOKENS = 16
_SESSION_ERRORS = {**ERRORS, 409: {**ERRORS[400], "description": "A turn is running."}}


def _busy() -> APIError:
    return APIError(409, "A turn is already running in this session.", code="session_busy")


async def _engine_tokens(service: Service, record: SessionRecord) -> int:
    return (await _engine_history(service, record))[0]


async def _engine_history(service: Service, record: SessionRecord) -> tuple[int, int]:
    """The session's tokens, and how many of them have KV entries its next turn reuses."""
    try:
        n, cached = await service.loop.call(
            lambda eng: (eng.session_num_tokens(record.id), eng.session_cached_tokens(record.id))
        )
    except (LoopClosed, ValueError, KeyError):
        return record.num_tokens, 0
    return int(n), int(cached)


@router.post("", response_model=SessionCreated, responses=ERRORS)
async def create_session(
    tenant: TenantDep,
    service: ReadyServiceDep,
    body: SessionCreateRequest | None = Body(None),
) -> SessionCreated:
    if body is not None:
        check_model(service, body.model)
    limit = tenant.max_sessions
    if limit is not None and service.sessions.count(tenant.name) >= limit:
        raise too_many(f"session limit reached ({limit})", 1.0, "quota_exceeded")
    record = service.sessions.new(tenant.name)
    await service.loop.call(lambda eng: eng.open_session(record.id, tenant.name))
    service.sessions.add(record)
    service.update_session_gauge()
    return SessionCreated(id=record.id, expires_at=int(record.expires_at))


@router.get("/{session_id}", response_model=SessionInfo, responses=ERRORS)
async def get_session(record: SessionDep, service: ServiceDep) -> SessionInfo:
    if not record.busy:
        record.num_tokens = await _engine_tokens(service, record)
    return SessionInfo.model_validate(record.public())


@router.delete("/{session_id}", response_model=SessionClosed, responses=_SESSION_ERRORS)
async def delete_session(record: SessionDep, service: ServiceDep) -> SessionClosed:
    if record.busy:
        raise _busy()
    zeroed = await service.close_session(record)
    return SessionClosed(id=record.id, zeroed_bytes=zeroed)


@router.post(
    "/{session_id}/completions", response_model=CompletionResponse, responses=_SESSION_ERRORS
)
async def session_completion(
    body: SessionCompletionRequest,
    request: Request,
    record: SessionDep,
    tenant: TenantDep,
    service: ReadyServiceDep,
) -> Response:
    check_model(service, body.model)
    if record.busy:
        raise _busy()
    record.busy = True  # claimed now: a concurrent turn gets 409 while we tokenize
    try:
        inp = await _turn_input(body, record, tenant.name, service)
    except BaseException:
        record.busy = False
        raise
    choices = Choices.build(service, tenant, [inp], 1, "cmpl")
    await choices.start(request)
    return await completion_response(
        choices, request, stream=bool(body.stream), include_usage=body.include_usage,
        model=service.model_name, return_token_ids=bool(body.return_token_ids),
    )  # fmt: skip


async def _turn_input(
    body: SessionCompletionRequest, record: SessionRecord, tenant: str, service: Service
) -> GenerationInput:
    engine = service.engine
    history, cached = await _engine_history(service, record)
    if service.sessions.get(tenant, record.id) is None:  # closed while we waited
        raise not_found("No such session.", "session_not_found")
    # Only the first turn starts with BOS; later turns continue the text.
    ids = encode_prompt(engine.tokenizer, body.single_prompt, add_special_tokens=history == 0)
    max_tokens = resolve_max_tokens(
        body.max_tokens, DEFAULT_MAX_TOKENS, history + len(ids), engine.max_model_len
    )
    return GenerationInput(
        prompt_token_ids=ids,
        sampling=build_sampling(body, max_tokens),
        stops=body.stop_list,
        session=record,
        history_tokens=history,
        cached_tokens=cached,
        prompt_text=body.prompt if isinstance(body.prompt, str) else None,
        echo=echo_text(engine.tokenizer, body.single_prompt) if body.echo else None,
    )
