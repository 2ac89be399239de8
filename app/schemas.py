"""Request and response bodies (OpenAI conventions, as vLLM implements them).

Unknown fields are rejected (400 naming the field) rather than silently ignored, except the
OpenAI fields listed below that are accepted when they ask for the default behaviour.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**63 - 1
MAX_CHOICES = 128  # choices of one request: its prompts times n
MAX_LOGPROBS = 20  # alternatives per token (engine.logprobs.MAX_LOGPROBS)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
PromptText = Annotated[str, Field(max_length=4_000_000)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions, chat completions and session turns."""

    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=256)]] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = Field(None, max_length=256)
    # vLLM extension: also return the generated token ids (non-streamed responses).
    return_token_ids: bool | None = False
    # vLLM extension: keep generating past EOS (benchmarks, tests).
    ignore_eos: bool | None = False
    # vLLM extension: token ids that end the output (kept in it, as EOS is).
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    # vLLM extension: no EOS or stop token ends the output before it has this many tokens.
    min_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    # Token id (as a string) -> a bias in [-100, 100] added to its logit before each draw.
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, str) and not value:
            return None
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids_and_values(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def logprob_count(self) -> int | None:
        """``SamplingParams.logprobs``: the alternatives per token asked for (None: no
        log-probabilities)."""
        return None

    @property
    def prompt_logprob_count(self) -> int | None:
        """``SamplingParams.prompt_logprobs`` (completions with ``echo``)."""
        return None


class CompletionRequest(SamplingFields):
    prompt: PromptText | list[TokenId] | list[PromptText] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, value: Any) -> Any:
        batch = value if _is_batch(value) else [value]
        if not batch or any(isinstance(p, list) and not p for p in batch):
            raise ValueError("the prompt must not be empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of texts or of token id lists)."""
        if _is_batch(self.prompt):
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def single_prompt(self) -> str | list[int]:
        """The first prompt (a session turn has one: ``SessionCompletionRequest``)."""
        return self.prompts[0]

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


class SessionCompletionRequest(CompletionRequest):
    """A session turn: the ``/v1/completions`` fields, ``prompt`` required, ``model`` optional;
    one prompt and one choice (the turn continues the session's text)."""

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if _is_batch(value) and len(value) != 1:
            raise ValueError("a session turn takes a single prompt")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("a session turn has one choice: n must be 1")
        return value


def _is_batch(prompt: Any) -> bool:
    """Whether ``prompt`` is a batch of prompts (texts or token id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


class TextPart(_Strict):
    type: Literal["text"]
    text: PromptText


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: PromptText | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class SessionCreateRequest(_Strict):
    """Optional body of ``POST /v1/sessions``."""

    model: str | None = Field(None, max_length=256)


# --------------------------------------------------------------------------- responses
class SpecUsage(BaseModel):
    """Speculative-decoding statistics of one request (extension of ``usage``)."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float = 0.0
    accepted_per_position: list[int] = []


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpecUsage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # only with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # only with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mtpserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"] = "session"
    created_at: int
    expires_at: int
    num_tokens: int
    busy: bool


class SessionCreated(BaseModel):
    id: str
    expires_at: int


class SessionClosed(BaseModel):
    id: str
    closed: Literal[True] = True
    zeroed_bytes: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
