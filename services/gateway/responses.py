"""From generate events to OpenAI bodies: whole responses, stream chunks, usage, logprobs.

Plain dicts shaped as `openai_types`' response models (the tests check them against the schema).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.constraints import ToolUse
from services.gateway.engine_client import Event

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


@dataclass
class Choice:
    """What one choice has received so far."""

    text: list[str] = field(default_factory=list)
    token_text_len: int = 0
    """Characters in the texts of the tokens whose logprobs were sent: where a stream's next
    `text_offset` starts (the text sent may lag behind, held back for a stop string or a character)."""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    """With echo and logprobs: one per prompt token after the first."""
    started: bool = False
    """A stream has sent this choice's first chunk."""

    def add(self, event: Event) -> None:
        self.text.append(event.text)
        self.num_tokens += len(event.token_ids)
        self.token_ids.extend(event.token_ids)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finish_reason is not None:
            self.finish_reason, self.error, self.stop_reason = event.finish_reason, event.error, event.stop_reason
            if event.usage is not None:
                self.num_tokens = event.usage.completion_tokens


def usage(prompt_lens: list[int], choices: list[Choice], generated: bool = True) -> dict:
    """`generated` False: an echo of the prompt alone (max_tokens 0), whose one engine token is not returned."""
    prompt = sum(prompt_lens)
    completion = sum(c.num_tokens for c in choices) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Echo:
    """A completion's prompt in front of each choice: its text and, with logprobs, its first token (which
    has no logprob) before the prompt logprobs the engine sent. `only`: max_tokens 0, the prompt alone."""

    texts: list[str]
    first_tokens: list[int]
    only: bool = False


def completion_response(public_id: str, created: int, model: str, choices: list[Choice], prompt_lens: list[int],
                        echo: Echo | None, token_text: TokenText, want_logprobs: bool,
                        prompt_ids: list[list[int]] | None = None) -> dict:
    """`prompt_ids`: with return_token_ids, each choice's prompt."""
    out = []
    for i, c in enumerate(choices):
        generated = not (echo and echo.only)
        logprobs = None
        if want_logprobs:
            prompt = echoed_logprobs(echo.first_tokens[i], c.prompt_logprobs or (), token_text) if echo else None
            offset = text_end(prompt) if prompt else 0
            parts = [p for p in (prompt, completion_logprobs(c.logprobs, token_text, offset) if generated else None)
                     if p and p["tokens"]]
            logprobs = joined(parts) if parts else None
        out.append({"index": i, "text": (echo.texts[i] if echo else "") + ("".join(c.text) if generated else ""),
                    "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if prompt_ids is not None:
            out[-1].update(prompt_token_ids=prompt_ids[i], token_ids=c.token_ids if generated else [])
    return {"id": public_id, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage(prompt_lens, choices, generated=not (echo and echo.only))}


def chat_response(public_id: str, created: int, model: str, choices: list[Choice], prompt_lens: list[int],
                  token_text: TokenText, want_logprobs: bool, tools: ToolUse | None = None,
                  token_bytes: TokenBytes | None = None, prompt_ids: list[int] | None = None) -> dict:
    """`prompt_ids`: with return_token_ids, the rendered prompt."""
    out = []
    for i, c in enumerate(choices):
        message, finish_reason = chat_message("".join(c.text), c.finish_reason, tools)
        out.append({"index": i, "message": message,
                    "logprobs": chat_logprobs(c.logprobs, token_text, token_bytes) if want_logprobs and c.logprobs
                    else None,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        if prompt_ids is not None:
            out[-1]["token_ids"] = c.token_ids
    body = {"id": public_id, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage(prompt_lens, choices)}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


def chat_message(text: str, finish_reason: str | None, tools: ToolUse | None) -> tuple[dict, str | None]:
    """A whole reply and its finish reason: with tool calls, `tool_calls` (content null unless the
    model wrote some before them) and "tool_calls" where the model stopped by itself (tool_calls_finish)."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = tools.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [msgspec.to_builtins(c) for c in calls]}
    return message, tool_calls_finish(finish_reason, tools)


def tool_calls_finish(finish_reason: str | None, tools: ToolUse) -> str | None:
    """OpenAI's finish reason for a reply that called tools: "tool_calls", unless it was cut short or
    tool_choice named the function (then "stop", as OpenAI answers and vLLM follows: vllm-project/vllm#25054)."""
    return "tool_calls" if finish_reason == "stop" and tools.named is None else finish_reason


def completion_chunk(public_id: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, stop_reason: str | int | None = None) -> dict:
    return {"id": public_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def chat_chunk(public_id: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, stop_reason: str | int | None = None) -> dict:
    return {"id": public_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def sse(payload: dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---- logprobs: entries {token_id, logprob, top_logprobs: [{token_id, logprob}]} ----------------

def _entry(entry: Any) -> tuple[int, float, list[tuple[int, float]]]:
    if isinstance(entry, dict):
        top = [(t["token_id"], t["logprob"]) for t in entry.get("top_logprobs") or ()]
        return entry["token_id"], entry["logprob"], top
    token_id, logprob, *rest = entry  # array-like TokenLogprob: [token_id, logprob, [[id, lp], ...]]
    return token_id, logprob, [tuple(t) for t in (rest[0] if rest else ())]


def completion_logprobs(entries: list[Any], token_text: TokenText, offset: int = 0) -> dict:
    """The legacy shape. Each `top_logprobs` dict holds the sampled token too (up to logprobs + 1 entries,
    as OpenAI documents and vLLM sends); `text_offset` counts the token texts from `offset`."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        token_id, logprob, top = _entry(entry)
        text = token_text(token_id)
        tokens.append(text)
        logprobs.append(logprob)
        tops.append({**{token_text(t): lp for t, lp in top}, text: logprob})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(first_token: int, prompt_entries: list[Any] | tuple[()], token_text: TokenText) -> dict:
    """The legacy shape for an echoed prompt: its first token without a logprob (null, as OpenAI and vLLM give
    it), then the others with theirs."""
    first = token_text(first_token)
    rest = completion_logprobs(list(prompt_entries), token_text, len(first))
    return joined([{"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}, rest])


def joined(parts: list[dict]) -> dict:
    """Legacy-shape logprobs one after the other (each part's text_offset already counts the ones before)."""
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}


def text_end(part: dict) -> int:
    """Where the next part's text_offset starts."""
    return part["text_offset"][-1] + len(part["tokens"][-1]) if part["tokens"] else 0


def chat_logprobs(entries: list[Any], token_text: TokenText, token_bytes: TokenBytes | None = None) -> dict:
    """OpenAI's chat shape. `bytes` are the token's own (`token_bytes`): the text of a token that is part of
    a character is U+FFFD, and the client rebuilds the text from the bytes."""
    def raw(token_id: int) -> list[int]:
        return list(token_bytes(token_id) if token_bytes is not None else token_text(token_id).encode())

    content = []
    for entry in entries:
        token_id, logprob, top = _entry(entry)
        content.append({"token": token_text(token_id), "logprob": logprob, "bytes": raw(token_id),
                        "top_logprobs": [{"token": token_text(t), "logprob": lp, "bytes": raw(t)} for t, lp in top]})
    return {"content": content}
