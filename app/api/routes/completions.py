"""``POST /v1/completions``."""

from fastapi import APIRouter, Request, Response

from app.api.deps import ReadyServiceDep, TenantDep, check_model
from app.api.routes.responses_doc import ERRORS
from app.generation import Generation, GenerationInput
from app.prompts import encode_prompt
from app.responses import completion_response
from app.sampling import build_sampling, resolve_max_tokens
from app.schemas import CompletionRequest, CompletionResponse

router = APIRouter(prefix="/v1", tags=["completions"])
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(
    body: CompletionRequest, request: Request, tenant: TenantDep, service: ReadyServiceDep
) -> Response:
    check_model(service, body.model)
    engine = service.engine
    ids = encode_prompt(engine.tokenizer, body.single_prompt)
    max_tokens = resolve_max_tokens(
        body.max_tokens, DEFAULT_MAX_TOKENS, len(ids), engine.max_model_len
    )
    inp = GenerationInput(
        prompt_token_ids=ids,
        sampling=build_sampling(body, max_tokens),
        stops=body.stop_list,
        prompt_text=body.prompt if isinstance(body.prompt, str) else None,
    )
    gen = Generation(service, tenant, inp, "cmpl")
    await gen.start(request)
    return await completion_response(
        gen, request, stream=bool(body.stream), include_usage=body.include_usage,
        model=service.model_name, return_token_ids=bool(body.return_token_ids),
    )  # fmt: skip
