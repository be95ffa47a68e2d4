"""The request body users send: an `orca generate` input line, and (as JSON) a NATS
`orca.v1.generate` request. Same fields as vLLM's offline API and the OpenAI API."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.outputs import TokenLogprob
from shared.sampling import SamplingKnobs, SamplingParams
from shared.structured import ResponseFormat, StructuredOutputs
from shared.tools import Tool, ToolCall, ToolChoice, check_tools, tool_constraint


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str | None = None
    """None only where OpenAI allows it: an assistant message that made tool calls."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's calls, as the final event of a request with tools gave them."""
    tool_call_id: str | None = None
    """A `tool` message: the call whose result `content` is."""


class ChatTurn(msgspec.Struct, frozen=True):
    """How the chat template ends the prompt (vLLM's two fields): open an assistant turn (the default), or
    leave the last message, an assistant's, open for the reply to continue (prefill)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self, last_role: str) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt false (the reply continues the "
                             "last message; no new turn opens)")
        if self.continue_final_message and last_role != "assistant":
            raise ValueError(f"continue_final_message continues the last message, an assistant's; it is {last_role!r}")


class GenerateRequest(SamplingKnobs, frozen=True, forbid_unknown_fields=True):
    """One request: its prompt (text, token ids or chat messages), the sampling fields (SamplingKnobs)
    and the fields of a body only: stop strings as given, constraints, tools, resume state."""

    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    """Chat messages, rendered with the checkpoint's chat template."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    priority: int = 0
    """Lower is served first (vLLM's convention); equal priorities are FCFS."""
    cache_salt: str | None = None
    """vLLM's: with prefix caching, only prefixes cached by requests with the same salt are reused (tenants
    cannot learn each other's prompts from how fast theirs start)."""
    resume_token_ids: list[int] | None = None
    """Resending a request whose tokenizer died (no tokenizer answers `orca.v1.generate.held` for
    its id): the token ids already received. The stream continues after them, to the same reply
    subject, as if it had never stopped (README, "When things fail")."""
    resume_seq: int = 0
    """With resume_token_ids: the number of events already received, so the resent stream's events
    continue their `seq` numbering."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's names: exactly one of json (a schema), json_object, regex, choice or grammar."""
    response_format: ResponseFormat | None = None
    """OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}."""
    tools: list[Tool] | None = None
    """With messages: OpenAI's tools, offered through the chat template; the final event has `tool_calls`."""
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    """OpenAI's: false allows at most one tool call."""
    add_generation_prompt: bool = True
    """With messages (ChatTurn): end the prompt with an opened assistant turn."""
    chat_template_kwargs: dict[str, Any] | None = None
    """With messages, vLLM's: more variables for the chat template (Qwen3's `enable_thinking`)."""
    continue_final_message: bool = False
    """With messages (ChatTurn): the reply continues the last message, an assistant's."""
    operation: Literal["chat", "text_completion"] | None = None
    """What the client called, for traces (OpenTelemetry's gen_ai.operation.name): the gateway renders chats
    into prompt_token_ids itself. None: chat for messages, else text_completion."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("id must be a non-empty string")
        given = [self.prompt is not None, self.prompt_token_ids is not None, self.messages is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.resume_seq < 0:
            raise ValueError("resume_seq must be >= 0")
        if (self.tools or self.tool_choice is not None) and self.messages is None:
            raise ValueError("tools and tool_choice need messages (the chat template offers the tools)")
        check_tools(self.tools, self.tool_choice)
        if self.messages is not None:
            self.chat_turn().check(self.messages[-1].role)
        elif not self.add_generation_prompt or self.continue_final_message or self.chat_template_kwargs:
            raise ValueError("add_generation_prompt, continue_final_message and chat_template_kwargs need messages")

    def chat_turn(self) -> ChatTurn:
        return ChatTurn(self.add_generation_prompt, self.continue_final_message)

    def sampling_params(self) -> SamplingParams:
        """Validated sampling parameters; ValueError names the bad field."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(**self.knobs(), stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                              structured_outputs=self.constraint()).validate()

    def constraint(self) -> StructuredOutputs | None:
        """The one thing the output must match, from structured_outputs, response_format or tool_choice."""
        given = {name: c for name, c in (
            ("structured_outputs", self.structured_outputs),
            ("response_format", self.response_format.structured() if self.response_format else None),
            ("tool_choice", tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls))) if c is not None}
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both constrain the output; give one")
        return next(iter(given.values()), None)


_decoder = msgspec.json.Decoder(GenerateRequest)


def decode_generate_request(data: bytes | str) -> GenerateRequest:
    """Parse one JSON request; raises ValueError with a readable reason."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed JSON: {exc}") from None


class Usage(msgspec.Struct, frozen=True):
    """A finished request's token counts, as OpenAI's `usage` gives them."""

    prompt_tokens: int
    """Tokens of the prompt (the rendered chat for messages)."""
    completion_tokens: int
    """Tokens generated, the final one included."""


class TopLogprob(msgspec.Struct, frozen=True):
    """One of the most likely tokens at a position, with its log-probability."""

    token_id: int
    logprob: float
    """Natural log, of the model's raw distribution (before penalties and temperature, as vLLM's default)
    but after a constraint's mask: a token it forbids has -9999.0, vLLM's floor."""


class EventLogprob(msgspec.Struct, frozen=True):
    """The log-probability of a sampled token and the top alternatives (`orca generate`'s shape)."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = []


def event_logprobs(logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[EventLogprob]:
    return [EventLogprob(lp.token_id, lp.logprob, [TopLogprob(t, v) for t, v in lp.top]) for lp in logprobs]


class GenerateEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """One streamed event on a NATS generate request's reply subject (JSON). The last one has
    `finish_reason` set ("stop", "length", "abort" or "error") and `usage`. `seq` numbers a
    stream's events 0, 1, 2, ... (absent means 0): a client that sees a gap or a repeat, or
    reconnects, can tell, and asks for a replay (`ReplayRequest`)."""

    id: str | None
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    """On the final event only."""
    logprobs: list[EventLogprob] | None = None
    """One per token in `token_ids`, when the request asked for logprobs."""
    prompt_logprobs: list[EventLogprob] | None = None
    """On the event with the first token, when the request asked for prompt_logprobs: one per prompt token
    after the first (the first has none: nothing comes before it)."""
    tool_calls: list[ToolCall] | None = None
    """On the final event of a request with tools, when the model called any: parsed from the whole
    output (the events' `text`, joined, is that output as the model wrote it)."""
    seq: int = 0
    stop_reason: str | int | None = None
    """On the final event of a request that one of its stop strings (that string) or stop token ids (that
    id) ended; absent for any other end, EOS included (vLLM's `stop_reason`)."""
    retry: bool = False
    """On an error event: the request was not served for a reason that passes (no tokenizer or engine
    for a while, the admission queue full, the instance shutting down): send it again later. A job goes
    back to JetStream instead of getting this as its result."""


class ReplayRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`orca.v1.generate.replay`: the tokenizer that holds request `id` (also for a while after its
    last event) publishes its events from `from_seq` on to the request's reply subject again, then
    answers `ReplayReply`. None answers for a request nobody holds: resend it (`resume_token_ids`)."""

    id: str
    from_seq: int = 0


class ReplayReply(msgspec.Struct, frozen=True):
    id: str
    held: bool = True
    next_seq: int = 0
    """The seq the next new event will carry (events up to it were just sent again)."""


class AbortRequest(msgspec.Struct, frozen=True):
    id: str


class HeldReply(msgspec.Struct, frozen=True):
    """The answer to {"id"} on `orca.v1.generate.held`, from the tokenizer that holds that request, or
    its events (for a while after its end, as `orca.v1.generate.replay` does); none answers otherwise."""

    id: str
    held: bool = True


_json_encoder = msgspec.json.Encoder()
_abort_decoder = msgspec.json.Decoder(AbortRequest)
_replay_decoder = msgspec.json.Decoder(ReplayRequest)


def encode_json(message: object) -> bytes:
    return _json_encoder.encode(message)


def decode_abort(data: bytes) -> AbortRequest:
    try:
        return _abort_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(str(exc)) from None


def decode_replay(data: bytes) -> ReplayRequest:
    try:
        return _replay_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(str(exc)) from None
