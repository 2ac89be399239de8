"""``POST /v1/completions``: one prompt or a batch of them, ``n`` choices each."""

from fastapi import APIRouter, Request, Response

from app.api.deps import ReadyServiceDep, TenantDep, check_model
from app.api.routes.responses_doc import ERRORS
from app.choices import Choices
from app.errors import bad_request
from app.generation import GenerationInput
from app.prompts import echo_text, encode_prompt
from app.responses import completion_response
from app.sampling import build_sampling, resolve_max_tokens
from app.schemas import MAX_CHOICES, CompletionRequest, CompletionResponse

router = APIRouter(prefix="/v1", tags=["completions"])
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(
    body: CompletionRequest, request: Request, tenant: TenantDep, service: ReadyServiceDep
) -> Response:
    check_model(service, body.model)
    engine = service.engine
    n = body.n or 1
    if len(body.prompts) * n > MAX_CHOICES:
        raise bad_request(
            f"n={n} choices of {len(body.prompts)} prompts make more than {MAX_CHOICES} choices",
            "n",
        )
    inputs = []
    for prompt in body.prompts:
        ids = encode_prompt(engine.tokenizer, prompt)
        max_tokens = resolve_max_tokens(
            body.max_tokens, DEFAULT_MAX_TOKENS, len(ids), engine.max_model_len
        )
        inputs.append(GenerationInput(
            prompt_token_ids=ids,
            sampling=build_sampling(body, max_tokens),
            stops=body.stop_list,
            prompt_text=prompt if isinstance(prompt, str) else None,
            echo=echo_text(engine.tokenizer, prompt) if body.echo else None,
        ))  # fmt: skip
    choices = Choices.build(service, tenant, inputs, n, "cmpl")
    await choices.start(request)
    return await completion_response(
        choices, request, stream=bool(body.stream), include_usage=body.include_usage,
        model=service.model_name, return_token_ids=bool(body.return_token_ids),
    )  # fmt: skip
