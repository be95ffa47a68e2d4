"""`orca generate`: serve a JSONL file of requests through the in-process engine.

Every line becomes one output line, in input order: a completion, or an error record that
names the line and the problem. All valid requests enter the engine at once; the
iteration scheduler serves them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any

import msgspec

from engine.llm_engine import Completion, LLMEngine
from shared.api import GenerateRequest, decode_generate_request, event_logprobs
from shared.outputs import FinishReason
from shared.tools import parse_tool_calls

_encoder = msgspec.json.Encoder()


def completion_record(c: Completion, request: GenerateRequest | None = None) -> dict[str, Any]:
    """`request`: the line it came from; with tools, the record has the `tool_calls` read from `text`."""
    record: dict[str, Any] = {
        "id": c.request_id, "prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids,
        "text": c.text, "finish_reason": c.finish_reason.label if c.finish_reason is not None else None,
    }
    if request is not None and request.tools and c.finish_reason != FinishReason.ERROR:
        _, calls = parse_tool_calls(c.text, request.tools, request.tool_choice, request.parallel_tool_calls)
        if calls:
            record["tool_calls"] = [msgspec.to_builtins(call) for call in calls]
    if c.logprobs is not None:
        record["logprobs"] = event_logprobs(c.logprobs)
    if c.error:
        record["error"] = c.error
    record["metrics"] = c.metrics()
    return record


def error_record(request_id: str | None, lineno: int, message: str) -> dict[str, Any]:
    return {"id": request_id, "finish_reason": "error", "error": f"line {lineno}: {message}"}


def _line_id(line: str) -> str | None:
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    return value.get("id") if isinstance(value, dict) and isinstance(value.get("id"), str) else None


def submit_lines(engine: LLMEngine, lines: Iterable[str]) -> list[dict[str, Any] | GenerateRequest]:
    """Add every valid line to the engine. Returns, in input order, an error record or the
    request whose completion will fill that slot."""
    slots: list[dict[str, Any] | GenerateRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            request = decode_generate_request(line)
            params = request.sampling_params()
            ids = engine.prompt_ids(request)
            engine.add_request(request.id, ids, params, priority=request.priority)
            slots.append(request)
        except ValueError as exc:
            slots.append(error_record(_line_id(line), lineno, str(exc)))
    return slots


def run_batch(engine: LLMEngine, lines: Iterable[str], out: IO[str], progress: bool = True) -> dict[str, int]:
    slots = submit_lines(engine, lines)
    requests = {s.id: s for s in slots if isinstance(s, GenerateRequest)}
    done: dict[str, dict[str, Any]] = {}
    bar = _progress_bar(len(requests), progress)
    while engine.has_unfinished:
        for delta in engine.step():
            if delta.finished:
                request_id = delta.completion.request_id
                done[request_id] = completion_record(delta.completion, requests.get(request_id))
                bar.update(1)
    bar.close()
    counts = {"requests": len(slots), "errors": 0}
    for slot in slots:
        record = done[slot.id] if isinstance(slot, GenerateRequest) else slot
        counts["errors"] += record["finish_reason"] == "error"
        out.write(_encoder.encode(record).decode() + "\n")
    return counts


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=not enabled)
