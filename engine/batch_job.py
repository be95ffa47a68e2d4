"""`orca generate`: serve a JSONL file of requests through the in-process engine.

Every line becomes one output line, in input order: a completion, or an error record that
names the line and the problem. All valid requests enter the engine at once; the
iteration scheduler serves them. A record is written, and flushed, as soon as every line
before it has been: an interrupted or crashed run leaves every record up to its first
unfinished line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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
    if c.stop_reason is not None:
        record["stop_reason"] = c.stop_reason
    if request is not None and request.tools and c.finish_reason != FinishReason.ERROR:
        _, calls = parse_tool_calls(c.text, request.tools, request.tool_choice, request.parallel_tool_calls)
        if calls:
            record["tool_calls"] = [msgspec.to_builtins(call) for call in calls]
    if c.logprobs is not None:
        record["logprobs"] = event_logprobs(c.logprobs)
    if c.prompt_logprobs is not None:
        record["prompt_logprobs"] = event_logprobs(c.prompt_logprobs)
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
            engine.add_request(request.id, ids, params, priority=request.priority, cache_salt=request.cache_salt)
            slots.append(request)
        except ValueError as exc:
            slots.append(error_record(_line_id(line), lineno, str(exc)))
    return slots


class BatchJob:
    """One run of `orca generate`. `out`: the output, or a function that opens it, called once the
    input has been read and every valid line is in the engine (so a run that fails before that, or is
    interrupted, leaves an existing output file as it was). `written` of `total` records are out."""

    def __init__(self, engine: LLMEngine, out: IO[str] | Callable[[], IO[str]], progress: bool = True) -> None:
        self.engine = engine
        self._out = out
        self.progress = progress
        self.sink: IO[str] | None = None
        """The output once it is open: the run has started."""
        self.total = 0
        self.written = 0
        self.errors = 0
        self._records: list[dict[str, Any] | None] = []

    @property
    def started(self) -> bool:
        return self.sink is not None

    def run(self, lines: Iterable[str]) -> dict[str, int]:
        slots = submit_lines(self.engine, lines)
        requests = {s.id: s for s in slots if isinstance(s, GenerateRequest)}
        index = {s.id: i for i, s in enumerate(slots) if isinstance(s, GenerateRequest)}
        self._records = [None if isinstance(s, GenerateRequest) else s for s in slots]
        self.total = len(slots)
        self.sink = self._out() if callable(self._out) else self._out
        bar = _progress_bar(len(requests), self.progress)
        try:
            self._write_ready()  # error records ahead of the first request
            while self.engine.has_unfinished:
                ready = False
                for delta in self.engine.step():
                    if delta.finished:
                        request_id = delta.completion.request_id
                        i = index[request_id]
                        self._records[i] = completion_record(delta.completion, requests[request_id])
                        ready |= i == self.written
                        bar.update(1)
                if ready:
                    self._write_ready()
        finally:
            bar.close()
        if self.written < self.total:
            unfinished = self.total - self.written
            raise RuntimeError(f"the engine stopped with {unfinished} of {self.total} records unwritten")
        return {"requests": self.total, "errors": self.errors}

    def _write_ready(self) -> None:
        """Write the records from the first unwritten one up to the first unfinished line, and flush.
        A Ctrl-C meanwhile waits until they are out, so `written` is what the output holds."""
        assert self.sink is not None
        records = self._records
        with _sigint_deferred():
            while self.written < self.total and records[self.written] is not None:
                record = records[self.written]
                records[self.written] = None  # written: not kept
                self.sink.write(_encoder.encode(record).decode() + "\n")
                self.errors += record["finish_reason"] == "error"
                self.written += 1
            flush = getattr(self.sink, "flush", None)
            if flush is not None:
                flush()


def run_batch(engine: LLMEngine, lines: Iterable[str], out: IO[str] | Callable[[], IO[str]],
              progress: bool = True) -> dict[str, int]:
    """Serve `lines`, writing their records to `out` (see BatchJob) in input order as they finish."""
    return BatchJob(engine, out, progress).run(lines)


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """A SIGINT that comes in the block is delivered when it ends (main thread only: elsewhere
    Python's handler cannot be swapped, nor runs)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:  # None: not Python's
        yield
        return
    pending: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=not enabled)
