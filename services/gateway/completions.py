"""POST /v1/completions and /v1/chat/completions: check, tokenize, publish, then answer whole or
as server-sent events.

The order is the cheap checks first (model, health, a full queue: 429 before any tokenizing or
publishing), then the output constraint and the tools (services/gateway/constraints.py: a bad
schema is a 400 before anything is tokenized), then the prompts against the context, then publish. The first event is awaited
before the HTTP status is chosen, so an error the system finds (the queue filled meanwhile, an
engine failed) is still a 4xx/5xx status and not a 200 stream with an error inside. A client that
goes away (HTTP disconnect, or Ray Serve cancelling the call) gets every unfinished request aborted.

With tools, a choice's text is read as tool calls (services/gateway/tool_stream.py streams them).

A stream is coalesced, never delayed: the first event goes out alone, at once; after that each write
carries everything that arrived since the last one (several tokens per chunk, the chunks of several
choices, and at the end the last chunk, usage and `[DONE]` together).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import msgspec

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.constraints import ToolUse, output_constraint, tool_use
from services.gateway.engine_client import Event, Generation, coalesce
from services.gateway.errors import APIError, error_body, from_generation_error
from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.prompts import (COMPLETIONS_DEFAULT_MAX_TOKENS, PromptInput, check_unsupported, truncated,
                                      generate_requests, resolve_max_tokens)
from services.gateway.responses import (SSE_DONE, Choice, Echo, chat_chunk, chat_logprobs, chat_response,
                                        completion_chunk, completion_logprobs, completion_response, echoed_logprobs,
                                        joined, sse, text_end, tool_calls_finish, usage)
from services.gateway.state import GatewayState
from services.gateway.tool_stream import ToolStream
from shared.api import ChatTurn
from shared.structured import StructuredOutputs


@dataclass(frozen=True)
class Extras:
    """vLLM's fields that shape an answer: the token ids beside the text (return_token_ids: `prompt_ids` per
    prompt), logprobs naming token ids (return_tokens_as_token_ids), usage on every chunk
    (stream_options.continuous_usage_stats)."""

    prompt_ids: list[list[int]] | None = None
    tokens_as_ids: bool = False
    continuous_usage: bool = False

    @staticmethod
    def of(body: CompletionRequest | ChatCompletionRequest, prompts: list[PromptInput]) -> Extras:
        options = body.stream_options
        return Extras([p.token_ids for p in prompts] if body.return_token_ids else None,
                      body.return_tokens_as_token_ids,
                      bool(options and options.include_usage and options.continuous_usage_stats))


@dataclass
class Call:
    """One HTTP call being answered: its requests' events and what has been sent of them."""

    state: GatewayState
    public_id: str
    chat: bool
    generation: Generation
    prompt_lens: list[int]
    echo: Echo | None
    want_logprobs: bool
    include_usage: bool
    tools: ToolUse | None = None
    extras: Extras = Extras()

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.per_prompt = len(self.generation.requests) // len(self.prompt_lens)
        """Choices per prompt (n): choice i answers prompt i // per_prompt."""
        if self.extras.tokens_as_ids:
            self.token_text, self.token_bytes = _token_id_text, None
        else:
            self.token_text, self.token_bytes = self.state.token_text, self.state.token_bytes
        self.model = self.state.settings.model_name
        self.choices = [Choice() for _ in self.generation.requests]
        self.tool_streams = [ToolStream(self.tools) for _ in self.choices] if self.tools else None
        self.pending_logprobs: list[list] = [[] for _ in self.choices]
        """Logprobs of text a tool stream holds back, to go with the next delta it sends."""

    def response(self) -> dict:
        ids = self.extras.prompt_ids
        if self.chat:
            return chat_response(self.public_id, self.created, self.model, self.choices, self.prompt_lens,
                                 self.token_text, self.want_logprobs, self.tools, self.token_bytes,
                                 ids[0] if ids is not None else None)
        return completion_response(self.public_id, self.created, self.model, self.choices, self.prompt_lens,
                                   self.echo, self.token_text, self.want_logprobs,
                                   [ids[i // self.per_prompt] for i in range(len(self.choices))]
                                   if ids is not None else None)

    def chunks(self, index: int, event: Event) -> list[dict]:
        choice = self.choices[index]
        first = not choice.started
        choice.started = True
        choice.add(event)
        logprobs = event.logprobs if self.want_logprobs and event.logprobs else None
        if self.chat:
            return self._chat_chunks(index, event, first, logprobs)
        echo = self.echo
        generated = not (echo and echo.only)
        text = (echo.texts[index] if first and echo else "") + (event.text if generated else "")
        # New tokens are a chunk even when they make no text yet (a byte of a character, text a stop
        # string may claim): the client sees the first token when it comes, as vLLM sends it.
        if not (text or event.token_ids or event.finish_reason or logprobs):
            return []
        parts, offset = [], choice.token_text_len
        if first and echo and self.want_logprobs:  # the prompt's own, in front of the first token's
            parts.append(echoed_logprobs(echo.first_tokens[index], event.prompt_logprobs or (), self.token_text))
            offset = text_end(parts[0])
        if logprobs and generated:
            parts.append(completion_logprobs(logprobs, self.token_text, offset))
        lp = joined(parts) if parts else None
        if lp is not None:
            choice.token_text_len = text_end(lp)
        chunk = completion_chunk(self.public_id, self.created, self.model, index, text, event.finish_reason, lp,
                                 event.stop_reason)
        if self.extras.prompt_ids is not None:
            if first:
                chunk["choices"][0]["prompt_token_ids"] = self.extras.prompt_ids[index // self.per_prompt]
            chunk["choices"][0]["token_ids"] = list(event.token_ids) if generated else []
        return [self._with_usage(chunk, index)]

    def _chat_chunks(self, index: int, event: Event, first: bool, logprobs: list | None) -> list[dict]:
        out = [{"role": "assistant", "content": ""}] if first else []
        finish_reason = event.finish_reason
        if self.tool_streams is None:
            if event.text or logprobs or (event.token_ids and not first):  # the role chunk opened the first
                out.append({"content": event.text})
        else:
            deltas, logprobs = self._tool_deltas(index, event, logprobs)
            out += deltas
        ids = self.extras.prompt_ids
        if ids is not None and event.token_ids and not out and finish_reason is None:
            out.append({})  # a tool stream holds the text back: the tokens still go out
        chunks = [chat_chunk(self.public_id, self.created, self.model, index, delta, None) for delta in out]
        if logprobs:
            chunks[-1]["choices"][0]["logprobs"] = chat_logprobs(logprobs, self.token_text, self.token_bytes)
        if finish_reason is not None:
            if self.tools is not None and self.tool_streams is not None and self.tool_streams[index].called:
                finish_reason = tool_calls_finish(finish_reason, self.tools)
            chunks.append(chat_chunk(self.public_id, self.created, self.model, index, {}, finish_reason,
                                     stop_reason=event.stop_reason))
        if ids is not None:
            if first:
                chunks[0]["prompt_token_ids"] = ids[0]
            chunks[0]["choices"][0]["token_ids"] = list(event.token_ids)
        return [self._with_usage(c, index) for c in chunks]

    def _tool_deltas(self, index: int, event: Event, logprobs: list | None) -> tuple[list[dict], list | None]:
        """The deltas of a choice with tools, and the logprobs to send with them: those of text held
        back wait in `pending_logprobs` for the next delta (or the last)."""
        stream, pending = self.tool_streams[index], self.pending_logprobs[index]
        deltas = stream.add(event.text)
        if event.finish_reason is not None:
            deltas += stream.finish()
        pending.extend(logprobs or ())
        if not deltas and event.finish_reason is None:
            return [], None
        self.pending_logprobs[index] = []
        if not deltas and pending:
            deltas = [{}]  # the last logprobs, with nothing left to say
        return deltas, pending or None

    def _with_usage(self, chunk: dict, index: int) -> dict:
        """`usage` null but on the last chunk, as OpenAI sends it; with continuous_usage_stats, the choice's so far
        (vLLM's)."""
        if self.extras.continuous_usage:
            prompt, completion = self.prompt_lens[index // self.per_prompt], self.choices[index].num_tokens
            if self.echo and self.echo.only:
                completion = 0
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict:
        return {"id": self.public_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(self.prompt_lens, self.choices, generated=not (self.echo and self.echo.only))}

    def write(self, batch: list[tuple[int, Event]]) -> tuple[bytes, bool]:
        """The server-sent events of `batch`, as one write; True when an error ended the stream (its
        error object is the write's last event)."""
        out = []
        for index, event in batch:
            if event.finish_reason == "error":
                error = from_generation_error(event.error, event.retry)
                out.append(sse(error_body(error.status, error.message, error.param, error.status)))
                return b"".join(out), True
            out.extend(sse(chunk) for chunk in self.chunks(index, event))
        return b"".join(out), False

    def ending(self, failed: bool) -> bytes:
        """What ends a stream (usage, unless it failed, then `[DONE]`)."""
        return (sse(self.usage_chunk()) if self.include_usage and not failed else b"") + SSE_DONE

    def count_tokens(self) -> None:
        """Once the call is over, however it ended (done, failed, aborted, its client gone): the tokens
        of every choice that reached an engine, as the engine counts them. A choice refused before any
        token (a full queue, no engine) counts no prompt tokens: no engine read them."""
        per_prompt = len(self.choices) // len(self.prompt_lens)
        generated = [(i, c.num_tokens) for i, c in enumerate(self.choices) if c.num_tokens]
        self.state.tokens["prompt"] += sum(self.prompt_lens[i // per_prompt] for i, _ in generated)
        self.state.tokens["completion"] += sum(n for _, n in generated)

    def add_all(self, batch: list[tuple[int, Event]]) -> None:
        """A whole (not streamed) response takes in `batch`; a generation error is an API error."""
        for index, event in batch:
            if event.finish_reason == "error":
                raise from_generation_error(event.error, event.retry)
            self.choices[index].add(event)


async def create_completion(state: GatewayState, body: CompletionRequest, http: Request) -> Response:
    state.check_model(body.model)
    state.check_can_take()
    check_unsupported(body)
    constraint = output_constraint(body)
    context, capacity = state.context_len(), state.client.status.kv_capacity_tokens()
    prompts = await state.prompts.for_completion(body, context)
    max_tokens = [resolve_max_tokens(len(p.token_ids), body.max_tokens, context, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                     capacity) for p in prompts]
    echo = None
    if body.echo:  # max_tokens 0: the prompt alone (the engine makes one token, which is not returned: vLLM's way)
        echo = Echo([_prompt_text(state, p) for p in prompts for _ in range(body.n)],
                    [p.token_ids[0] for p in prompts for _ in range(body.n)], only=body.max_tokens == 0)
        if echo.only:
            max_tokens = [1] * len(prompts)
    elif body.max_tokens == 0:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)", param="max_tokens")
    prompt_logprobs = body.logprobs if body.echo else None  # echo with logprobs scores the prompt too
    return await _serve(state, http, body, False, prompts, max_tokens, body.logprobs, echo, constraint,
                        prompt_logprobs=prompt_logprobs)


async def create_chat_completion(state: GatewayState, body: ChatCompletionRequest, http: Request) -> Response:
    state.check_model(body.model)
    state.check_can_take()
    check_unsupported(body)
    tools = tool_use(body)
    constraint = output_constraint(body, tools)
    prompt = await state.prompts.for_chat(body.messages, tools.template_tools() if tools else None,
                                          ChatTurn(body.add_generation_prompt, body.continue_final_message),
                                          body.chat_template_kwargs, body.documents)
    prompt = truncated(prompt, body.truncate_prompt_tokens, state.context_len())
    asked = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = resolve_max_tokens(len(prompt.token_ids), asked, state.context_len(), None,
                                    state.client.status.kv_capacity_tokens(), param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await _serve(state, http, body, True, [prompt], [max_tokens], logprobs, None, constraint, tools)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _prompt_text(state: GatewayState, prompt: PromptInput) -> str:
    return prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.token_ids)


async def _serve(state: GatewayState, http: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                 prompts: list[PromptInput], max_tokens: list[int], logprobs: int | None,
                 echo: Echo | None, constraint: StructuredOutputs | None = None,
                 tools: ToolUse | None = None, prompt_logprobs: int | None = None) -> Response:
    public_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    requests = generate_requests(public_id, body, prompts, max_tokens, logprobs, state.prompts.vocab_size, constraint,
                                 prompt_logprobs, chat)
    state.check_can_take()  # tokenizing took a while: look again before publishing
    generation = await state.client.submit(public_id, requests)
    watcher = asyncio.create_task(_abort_on_disconnect(http, generation))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    call = Call(state, public_id, chat, generation, [len(p.token_ids) for p in prompts], echo,
                logprobs is not None, include_usage, tools, Extras.of(body, prompts))
    streaming = False
    try:
        first = await _first_event(generation)
        if body.stream:
            streaming = True
            return EventStream(_stream(call, first, watcher), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        batch: list[tuple[int, Event]] | None = [first]
        while batch is not None:
            call.add_all(batch)
            batch = await generation.take()
        return Response(msgspec.json.encode(call.response()), media_type="application/json")
    finally:
        if not streaming:
            watcher.cancel()
            generation.close()
            call.count_tokens()


class EventStream(StreamingResponse):
    """A stream whose client's disconnect the call watches itself (`_abort_on_disconnect`, then the only
    reader of `receive`). Starlette watches too under ASGI before 2.4, which uvicorn's HTTP servers report
    (2.3): it runs the stream in an anyio task group beside a second reader, 131 us a response here against
    7 without, spent before the first chunk goes out."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the connection broke mid-write: as Starlette answers it under ASGI 2.4
            raise ClientDisconnect() from None


async def _first_event(generation: Generation) -> tuple[int, Event]:
    item = await generation.next()
    if item is None:  # closed before any event: the client went away
        raise APIError(499, "the client closed the request before it started", code="client_closed_request")
    index, event = item
    if event.finish_reason == "error" and not event.token_ids:
        raise from_generation_error(event.error, event.retry)
    return item


async def _stream(call: Call, first: tuple[int, Event], watcher: asyncio.Task):
    """The first event at once, then one write per `take()`: what arrived while the last write was
    on its way leaves together."""
    batch: list[tuple[int, Event]] | None = coalesce([first])  # an error after text: the text, then the error
    try:
        while batch is not None:
            body, failed = call.write(batch)
            if failed or call.generation.complete:
                yield body + call.ending(failed)
                return
            if body:
                yield body
            batch = await call.generation.take()
        yield call.ending(False)  # closed: the client has gone
    finally:
        watcher.cancel()
        call.generation.close()
        call.count_tokens()


async def _abort_on_disconnect(http: Request, generation: Generation, linger_s: float = 60.0) -> None:
    """Wait for the client to go away; then abort what is still running for it, and stop listening
    once its last events are in (in case no one is left reading them)."""
    try:
        while (await http.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - the server lost the connection: the same as a disconnect
        pass
    generation.abort()
    try:
        await asyncio.wait_for(generation.done.wait(), linger_s)
    except TimeoutError:
        pass
    generation.close()
