"""``POST /v1/chat/completions`` (the prompt comes from the tokenizer's chat template)."""

from fastapi import APIRouter, Request, Response

from app.api.deps import ReadyServiceDep, TenantDep, check_model
from app.api.routes.responses_doc import ERRORS
from app.choices import Choices
from app.generation import GenerationInput
from app.prompts import chat_prompt_ids
from app.responses import chat_response
from app.sampling import build_sampling, resolve_max_tokens
from app.schemas import ChatCompletionRequest, ChatCompletionResponse

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post("/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, tenant: TenantDep, service: ReadyServiceDep
) -> Response:
    check_model(service, body.model)
    engine = service.engine
    ids = chat_prompt_ids(engine.tokenizer, body.messages)
    requested = body.max_completion_tokens or body.max_tokens
    default = service.settings.default_max_tokens
    max_tokens = resolve_max_tokens(requested, default, len(ids), engine.max_model_len)
    text = None
    if service.settings.log_text:
        text = "\n".join(m.text() for m in body.messages)
    inp = GenerationInput(ids, build_sampling(body, max_tokens), body.stop_list, prompt_text=text)
    choices = Choices.build(service, tenant, [inp], body.n or 1, "chatcmpl")
    await choices.start(request)
    return await chat_response(
        choices, request, stream=bool(body.stream), include_usage=body.include_usage,
        model=service.model_name, return_token_ids=bool(body.return_token_ids),
    )  # fmt: skip
