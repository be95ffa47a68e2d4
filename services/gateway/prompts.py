"""From an OpenAI request to the GenerateRequests the gateway publishes.

The gateway tokenizes (it must know prompt lengths to check them against the context and to
default chat's max_tokens to the rest of it) and then sends token ids, so nothing is tokenized
twice. Prompt i's choice j is request `<id>-<i * n + j>`, seeded `seed + j` when a seed is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.tokenizer import Tokenizer, check_template_kwargs
from services.gateway.errors import APIError
from services.gateway.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from shared.api import ChatTurn, GenerateRequest
from shared.structured import StructuredOutputs
from shared.tools import template_messages

T = TypeVar("T")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat's default is the rest of the context."""


@dataclass(frozen=True)
class PromptInput:
    token_ids: list[int]
    text: str | None = None
    """The prompt as text (for `echo`), when it came as text."""


class Prompts:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # One thread: off the event loop, and a Hugging Face fast tokenizer is not safe to share
        # between threads ("Already borrowed").
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def for_completion(self, request: CompletionRequest, context: int) -> list[PromptInput]:
        """The request's prompts as token ids, with vLLM's add_special_tokens and truncate_prompt_tokens."""
        prompt, special = request.prompt, request.add_special_tokens
        if isinstance(prompt, str):
            prompts = [await self.encode(prompt, special)]
        elif isinstance(prompt[0], str):
            prompts = [await self.encode(p, special) for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [PromptInput(self.checked(prompt))]
        else:
            prompts = [PromptInput(self.checked(ids)) for ids in prompt]
        return [truncated(p, request.truncate_prompt_tokens, context) for p in prompts]

    async def for_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None,
                       turn: ChatTurn = ChatTurn(), template_kwargs: dict[str, Any] | None = None,
                       documents: list[dict[str, Any]] | None = None) -> PromptInput:
        return PromptInput(await self.run(self.render_chat, messages, tools, turn, template_kwargs, documents))

    def render_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None,
                    turn: ChatTurn = ChatTurn(), template_kwargs: dict[str, Any] | None = None,
                    documents: list[dict[str, Any]] | None = None) -> list[int]:
        """The messages (and the tools offered, transformers' `tools=`) through the chat template, with the
        request's chat_template_kwargs and documents."""
        try:
            check_template_kwargs(template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from None
        for i, message in enumerate(messages):
            try:
                message_text(message).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(400, f"messages.{i}.content is not valid Unicode: a lone surrogate at character "
                                    f"{exc.start}", param="messages") from None
        dicts = template_messages([{**m.model_dump(exclude_none=True), "content": message_text(m)} for m in messages])
        try:
            turn.check(dicts[-1]["role"])
            return self.tokenizer.apply_chat_template(dicts, tools, turn=turn, template_kwargs=template_kwargs,
                                                      documents=documents)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except Exception as exc:  # noqa: BLE001 - a Jinja template error is still about the messages
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None

    async def tokens(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; a 400 for text that is no Unicode (JSON lets a lone UTF-16 surrogate
        through, as "\\ud800", which the tokenizer refuses with a TypeError)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, f"{param} is not valid Unicode: a lone surrogate at character {exc.start}",
                           param=param) from None
        return await self.run(self.tokenizer.encode, text, add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool = True) -> PromptInput:
        ids = await self.tokens(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        return PromptInput(ids, text)

    def checked(self, ids: list[int], param: str = "prompt") -> list[int]:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            what = "prompt token id" if param == "prompt" else "token id"
            raise APIError(400, f"{what} {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        return ids


def truncated(prompt: PromptInput, keep: int | None, context: int) -> PromptInput:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens of the prompt (-1: of the context length); its text
    (for echo) is then that of the tokens kept."""
    keep = context if keep == -1 else keep
    if keep is None or len(prompt.token_ids) <= keep:
        return prompt
    return PromptInput(prompt.token_ids[-keep:])


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def resolve_max_tokens(prompt_len: int, asked: int | None, context: int, default: int | None,
                       capacity: int | None = None, param: str = "max_tokens") -> int:
    """max_tokens for one prompt: the asked value if prompt + it fits the context (else a 400 naming
    both numbers); unasked, `default` (None: all the room left, within the KV cache too) capped by the room."""
    if prompt_len >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                            f"{prompt_len} tokens, leaving no room to generate. Please shorten the prompt.",
                       param="prompt", code="context_length_exceeded")
    room = context - prompt_len
    if asked is None:
        if capacity is not None and capacity > prompt_len:
            room = min(room, capacity - prompt_len)
        return room if default is None else min(default, room)
    if prompt_len + asked > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} in the "
                            f"completion). Please reduce the prompt or {param}.",
                       param=param, code="context_length_exceeded")
    return asked


def check_unsupported(request: SamplingFields) -> None:
    """Fields accepted for compatibility but only in their neutral form."""
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if request.truncate_prompt_tokens == 0:
        raise APIError(400, "truncate_prompt_tokens must be >= 1 (or -1: as many as the context holds)",
                       param="truncate_prompt_tokens")
    if isinstance(request, CompletionRequest) and request.best_of not in (None, request.n):
        raise APIError(400, "best_of must equal n (beam search and best-of are not supported)", param="best_of")
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def logit_bias(request: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """The request's logit_bias by token id; a key that is no token id of the vocabulary is a 400."""
    if not request.logit_bias:
        return None
    bias = {}
    for key, value in request.logit_bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias key {key!r} is not a token id of the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        bias[int(key)] = value
    return bias


def generate_requests(public_id: str, request: SamplingFields, prompts: list[PromptInput], max_tokens: list[int],
                      logprobs: int | None, vocab_size: int, constraint: StructuredOutputs | None = None,
                      prompt_logprobs: int | None = None, chat: bool = False) -> list[GenerateRequest]:
    """`constraint`: what every output must match (checked already: `constraints.output_constraint`);
    `chat`: the prompts are rendered chats (traced as chat, not text_completion)."""
    bias = logit_bias(request, vocab_size)
    for field in ("stop_token_ids", "allowed_token_ids"):
        bad = next((t for t in getattr(request, field) or () if t >= vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=field)
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(request.n):
            seed = None if request.seed is None else (request.seed + j) % 2**63
            generate = GenerateRequest(
                id=f"{public_id}-{p * request.n + j}", prompt_token_ids=prompt.token_ids,
                max_tokens=max_tokens[p], temperature=request.temperature, top_p=request.top_p,
                top_k=request.top_k, min_p=request.min_p, seed=seed, stop=request.stop,
                stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, min_tokens=request.min_tokens,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty, logit_bias=bias, structured_outputs=constraint,
                allowed_token_ids=tuple(request.allowed_token_ids) if request.allowed_token_ids else None,
                cache_salt=request.cache_salt,
                priority=request.priority, operation="chat" if chat else "text_completion")
            try:
                generate.sampling_params()
            except ValueError as exc:  # "<field>=<value> <rule>": the field is the error's param
                field = str(exc).partition("=")[0]
                raise APIError(400, str(exc), param=field if field in SamplingFields.model_fields else None) from None
            out.append(generate)
    return out
