"""The OpenAI-compatible HTTP bodies, as pydantic models (FastAPI builds /openapi.json from them).

Requests are strict (no "1" for 1, no NaN, unknown fields refused: OpenAI refuses them too), and
every range the gateway enforces is in the schema, so the schema says what the routes accept. A field
that has a default also takes null, meaning that default: OpenAI's optional fields are nullable, and its
SDK sends null for an argument given as None.
What only the running system knows (the context length, the vocabulary) is checked at request time.
Responses are built as plain dicts on the hot path; the response models here document their shape.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

MAX_N = 16
"""Most choices per prompt (`n`)."""
MAX_PROMPTS = 32
"""Most prompts in one completions request (a list of prompts)."""
MAX_STOP = 16
MAX_TOOLS = 128
"""Most functions in one chat request's `tools` (OpenAI's limit)."""
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]

TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# A text prompt may be empty: it is refused only if it tokenizes to nothing (a tokenizer that adds BOS gives one token).
Prompt = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None


def _nullable_optionals(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The schema of a request model: every field that is not required also takes null."""
    required = set(schema.get("required", ()))
    for key, prop in schema.get("properties", {}).items():
        if key in required or {"type": "null"} in prop.get("anyOf", ()):
            continue
        notes = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
        schema["properties"][key] = {"anyOf": [prop, {"type": "null"}], **notes}


ANY_VALUE = object()
"""In `Strict.inert`: every value of that field changes nothing here."""


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra=_nullable_optionals)
    inert: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Undeclared fields that clients send (the SDK's own models round-tripped, clients that send every
    field), in the values that ask for nothing this server lacks: dropped before validation. Any other
    value of such a field is still refused, naming it."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = _optional_keys(cls)
        return {key: value for key, value in data.items()
                if (value is not None or key not in optional) and not _is_inert(value, cls.inert.get(key))}


def _is_inert(value: Any, inert_values: tuple[Any, ...] | None) -> bool:
    if inert_values is None:
        return False
    # by type too: 0 == False, and `use_beam_search: 0` is no boolean
    return any(v is ANY_VALUE or (type(value) is type(v) and value == v) for v in inert_values)


@cache
def _optional_keys(model: type[BaseModel]) -> frozenset[str]:
    """The JSON keys (names and aliases) of the fields of `model` that have a default."""
    return frozenset(key for name, field in model.model_fields.items() if not field.is_required()
                     for key in (name, field.alias) if key is not None)


class StreamOptions(Strict):
    include_usage: bool = False
    """Send a last chunk (empty `choices`) with the usage of the whole request."""
    continuous_usage_stats: bool = False
    """vLLM extra: with include_usage, every chunk also carries its choice's usage so far."""


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: give exactly one field. The output is constrained to match it."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    """A JSON schema, as an object or as JSON text."""
    regex: str | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's syntax) or a GBNF one (llama.cpp's)."""
    json_object: bool | None = None
    """true: any JSON object."""


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]
    """Any JSON object."""


class JsonSchema(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    """Accepted; not shown to the model."""
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None
    """Accepted: objects that list their properties allow no others either way (OpenAI's strict mode)."""


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


VLLM_INERT: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False, None), "prompt_logprobs": (None,), "spaces_between_special_tokens": (True,),
    "length_penalty": (1.0, 1), "bad_words": ([],), "request_id": (None,)}
"""vLLM's request fields in the values that ask for nothing this server lacks (clients that send every field)."""


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
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    """vLLM extra: only these tokens can be sampled."""
    skip_special_tokens: bool = True
    """vLLM extra: special tokens are left out of the text (their ids and logprobs stay)."""
    include_stop_str_in_output: bool = False
    """vLLM extra: the text keeps the stop string (or the stop token's text) that ended it."""
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """vLLM extra: until this many tokens are out, EOS and the stop token ids cannot be sampled and stop
    strings do not match."""
    ignore_eos: bool = False
    """vLLM extra: generate max_tokens tokens whatever the model says (an output constraint that is complete
    still ends the request: no token could follow)."""
    seed: Annotated[int, Field(ge=-2**63, lt=2**63)] | None = None
    """Any 64-bit signed integer, as vLLM takes it. With n > 1, choice i uses seed + i."""
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    """vLLM extra."""
    priority: Annotated[int, Field(ge=-2**31, lt=2**31)] = 0
    """vLLM extra: lower is served first, equal priorities first come first served; it orders admission and,
    under a policy that preempts, which request gives way."""
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    """Token id (as a string, as OpenAI takes it) -> a bias in [-100, 100] added to its logit before
    sampling: -100 all but bans the token, 100 all but forces it."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    """vLLM extra: with prefix caching, only prefixes cached by requests with the same salt are reused (give
    each tenant a long random one: it cannot learn another's prompts from how fast its own start)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """vLLM extra: keep only the prompt's last this many tokens (-1: as many as the context holds)."""
    return_token_ids: bool = False
    """vLLM extra: the token ids beside the text: `token_ids` on each choice (and chunk), the prompt's
    `prompt_token_ids` on each completion choice, or once on a chat response (its first chunk)."""
    return_tokens_as_token_ids: bool = False
    """vLLM extra: logprobs name their tokens `token_id:<id>` (a token that is part of a character has no
    text of its own)."""
    user: Annotated[str, Field(max_length=256)] | None = None
    """Accepted and ignored."""
    store: bool | None = None
    """Accepted and ignored: nothing is stored."""
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    """Accepted and ignored."""
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    """Accepted and ignored: there is one tier."""
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    """Accepted and ignored: with `--enable-prefix-caching` shared prefixes are reused whatever the key."""
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    """Accepted and ignored."""
    response_format: ResponseFormat | None = None
    """OpenAI's: text, json_object, or json_schema (the output matches `json_schema.schema`)."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM extra: constrain the output to a JSON schema, a regex, a choice or a grammar."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older spelling of structured_outputs.json (also guided_regex, guided_choice, guided_grammar)."""
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    inert: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": (None, ""), **VLLM_INERT}
    prompt: Prompt
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    add_special_tokens: bool = True
    """vLLM extra: the tokenizer's special tokens around a text prompt (a BOS), as it adds them by default."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    """Return the prompt in front of the completion (with logprobs, the prompt's too; with max_tokens 0, the
    prompt alone)."""
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    """0 only with echo."""
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    """Accepted only when equal to n."""


class TextPart(Strict):
    inert: ClassVar[dict[str, tuple[Any, ...]]] = {"cache_control": (ANY_VALUE,)}
    """A prompt-caching hint (Anthropic's, sent through LiteLLM and the like): prefix reuse needs none."""
    type: Literal["text"]
    text: str


Content = str | list[TextPart] | None


class FunctionCall(Strict):
    name: str
    arguments: str
    """JSON text."""


class ToolCall(Strict):
    """A tool call an assistant message made (chat history)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    inert: ClassVar[dict[str, tuple[Any, ...]]] = {
        # an assistant message as the openai SDK returns it (`message.model_dump()`), sent back in the history
        "refusal": (None,), "annotations": (None, []), "audio": (None,), "function_call": (None,),
        "cache_control": (ANY_VALUE,)}
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's tool calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message: the id of the call whose result `content` is."""

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has tool_call_id")
        return self


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of an object; none: no parameters."""
    strict: bool | None = None
    """Accepted: with tool_choice required or a named function the arguments always match `parameters`."""


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    inert: ClassVar[dict[str, tuple[Any, ...]]] = {
        "functions": (None,), "function_call": (None,), "reasoning_effort": (None,), "audio": (None,),
        "prediction": (None,), "web_search_options": (None,), "add_special_tokens": (False,), "echo": (False,),
        "chat_template": (None,), **VLLM_INERT}
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM extra: more variables for the chat template (Qwen3's `enable_thinking`)."""
    documents: list[dict[str, Any]] | None = None
    """vLLM extra: documents for a retrieval-augmented chat template (transformers' `documents=`)."""
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Wins over max_tokens; without either, the rest of the context."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    """Function tools, offered to the model through the chat template."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """`auto` (the default with tools): the model may call tools, in the Hermes format
    (`<tool_call>{"name", "arguments"}</tool_call>`); `required`: it calls one or more; a named
    function: it calls that one. `required` and named calls are constrained to the parameter schemas."""
    parallel_tool_calls: bool = True
    """false: at most one tool call."""
    add_generation_prompt: bool = True
    """vLLM extra: end the prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """vLLM extra: the last message, an assistant's, is left open and the reply continues it (prefill);
    needs add_generation_prompt false."""
    modalities: Annotated[list[Literal["text"]], Field(min_length=1)] | None = None
    """Only ["text"]."""


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    """Give exactly one of prompt or messages (rendered with the chat template, as chat does)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """With messages: as chat's."""
    add_special_tokens: bool | None = None
    """vLLM's: with prompt, the tokenizer's special tokens around it (default true, as completions add them);
    with messages, the chat template places them (true is refused)."""


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


NOT_SUPPORTED = {
    "suffix": "suffix (insertion) is not supported",
    "functions": "functions and function_call are OpenAI's deprecated form: give tools and tool_choice",
    "function_call": "functions and function_call are OpenAI's deprecated form: give tools and tool_choice",
    "reasoning_effort": "reasoning_effort is not supported: the served model does not reason",
    "prediction": "predicted outputs (prediction) are not supported",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "prompt_logprobs in vLLM's shape is not supported here: on /v1/completions, echo with "
                       "logprobs gives the prompt's (orca generate and NATS requests take prompt_logprobs)",
    "spaces_between_special_tokens": "spaces_between_special_tokens false is not supported: special tokens decode "
                                     "as the tokenizer joins them",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "bad_words": "bad_words is not supported: logit_bias -100 bans single tokens",
    "request_id": "request_id is not supported: each response has its own id (and OpenTelemetry traces each request)",
    "add_special_tokens": "add_special_tokens true is not supported on chat: the chat template places the special "
                          "tokens",
    "echo": "echo is not supported on chat",
    "chat_template": "a request's own chat_template is not supported: start the server with --chat-template",
}
"""OpenAI's and vLLM's request fields this server does not implement, and what it says when one is sent (a
400: ignoring them would change what the client gets without telling it)."""


# ---- responses ---------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChoiceEnd(BaseModel):
    """What every choice, whole or streamed, carries beside its content and logprobs."""

    index: int
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the choice (vLLM's); null for EOS or any other end."""
    token_ids: list[int] | None = None
    """With return_token_ids: the choice's generated tokens (in a stream, those of the chunk)."""


class CompletionChoice(ChoiceEnd):
    text: str
    logprobs: CompletionLogprobs | None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids (in a stream, on the choice's first chunk)."""


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


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    """null when the reply is tool calls only."""
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(ChoiceEnd):
    message: AssistantMessage
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the rendered prompt."""


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None
    """A fragment: a call's arguments are its fragments joined."""


class ToolCallDelta(BaseModel):
    index: int
    """Which call of the message this fragment belongs to."""
    id: str | None = None
    """On a call's first fragment (with its type and name)."""
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ChoiceEnd):
    delta: ChatDelta
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(BaseModel):
    """One streamed chat event; the last one (with stream_options.include_usage) has empty `choices`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids, on the first chunk."""


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


class Version(BaseModel):
    version: str
    """orca-serve's version (vLLM's GET /version gives vLLM's)."""


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
