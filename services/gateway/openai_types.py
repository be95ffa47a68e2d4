"""The OpenAI-compatible HTTP bodies, as pydantic models (FastAPI builds /openapi.json from them).

Requests are strict (no "1" for 1, no NaN, unknown fields refused: OpenAI refuses them too), and
every range the gateway enforces is in the schema, so the schema says what the routes accept.
What only the running system knows (the context length, the vocabulary) is checked at request time.
Responses are built as plain dicts on the hot path; the response models here document their shape.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.sampling import MAX_TOP_LOGPROBS

MAX_N = 16
"""Most choices per prompt (`n`)."""
MAX_PROMPTS = 32
"""Most prompts in one completions request (a list of prompts)."""
MAX_STOP = 16

TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    """Send a last chunk (empty `choices`) with the usage of the whole request."""


class SamplingFields(Strict):
    """What completions and chat share: OpenAI's sampling fields plus vLLM's extras."""

    model: str | None = None
    """The served model name (GET /v1/models); optional, as there is one model."""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    """vLLM extra: 0 or -1 disables top-k."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    """vLLM extra."""
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    """vLLM extra."""
    ignore_eos: bool = False
    """vLLM extra: generate max_tokens tokens whatever the model says."""
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    """With n > 1, choice i uses seed + i."""
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    """vLLM extra."""
    logit_bias: dict[str, float] | None = None
    """Accepted only empty: not supported."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    """Accepted and ignored."""


class CompletionRequest(SamplingFields):
    prompt: Prompt
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    """Return the prompt in front of the completion."""
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    """Accepted only when equal to n."""
    suffix: None = None
    """Not supported (must be null)."""


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart] | None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Annotated[str, Field(max_length=256)] | None = None


class ResponseFormat(Strict):
    type: Literal["text"]
    """Only plain text is supported."""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Wins over max_tokens; without either, the rest of the context."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict], Field(max_length=0)] | None = None
    """Not supported: null or empty."""
    tool_choice: Literal["none"] | None = None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    """Give exactly one of prompt or messages (rendered with the chat template, as chat does)."""


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ---------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (`usage` null but on the last chunk when asked)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(BaseModel):
    """One streamed chat event; the last one (with stream_options.include_usage) has empty `choices`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class AbortResponse(BaseModel):
    id: str
    object: Literal["abort"]
    aborted: list[str]
    """The internal request ids an abort was sent for."""


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    num_engines_ready: int
    num_tokenizers: int = 0
    queue_len: int | None
    max_queue_len: int | None
    reason: str | None = None
    """Why a request could not be served now (with the 503)."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
