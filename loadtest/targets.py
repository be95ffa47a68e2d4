"""What `orca bench` drives: a running `orca serve` over NATS or HTTP, or the engine in process.

- `NatsTarget`: publishes each request (JSON `GenerateRequest`) to `orca.v1.generate` with its
  own reply subject and records the `GenerateEvent`s that stream back.
- `HttpTarget`: POSTs OpenAI streaming completions (`/v1/completions`, `stream: true`) and
  reads the server-sent events.
- `InProcessTarget`: an `engine.llm_engine.LLMEngine`, stepped by the load generator.
- `launch_serve`: starts `orca serve` with an engine config's flags (`shared.flags.engine_argv`) on
  free ports and stops it afterwards, so one `orca bench` invocation can measure several policies
  of a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec

from loadtest.loadgen import StepEvent
from loadtest.report import RequestRecord
from shared import subjects
from shared.api import GenerateEvent, GenerateRequest, encode_json
from shared.config import EngineConfig
from shared.flags import engine_argv
from shared.outputs import FinishReason
from shared.sampling import SamplingParams

_event_decoder = msgspec.json.Decoder(GenerateEvent)


class NatsTarget:
    """Streams over core NATS; one connection and one wildcard subscription for the whole run."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self._nc = None
        self._inbox = ""
        self._open: dict[str, tuple[RequestRecord, asyncio.Future]] = {}

    async def __aenter__(self) -> NatsTarget:
        import nats

        said: list[str] = []

        async def one_line(exc: Exception) -> None:  # nats.py's default prints a traceback per attempt
            if not said or said[-1] != str(exc):
                said.append(str(exc))
                print(f"orca bench: NATS: {exc}", file=sys.stderr)

        try:
            # nats.py's defaults try a server that is not there for two minutes (60 tries, 2 s apart)
            self._nc = await nats.connect(self.nats_url, name="orca-bench", pending_size=256 * 1024 * 1024,
                                          error_cb=one_line, max_reconnect_attempts=4, reconnect_time_wait=0.5)
        except Exception as exc:  # noqa: BLE001 - nothing to measure: one line for the CLI, not a traceback
            from services.bus import redact_url

            raise ValueError(f"cannot connect to NATS at {redact_url(self.nats_url)}: {exc}") from None
        self._inbox = self._nc.new_inbox()
        await self._nc.subscribe(self._inbox + ".*", cb=self._on_event)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.drain()

    async def _on_event(self, msg) -> None:
        now = time.perf_counter()
        entry = self._open.get(msg.subject.rsplit(".", 1)[-1])
        if entry is None:
            return
        record, done = entry
        event = _event_decoder.decode(msg.data)
        record.add_chunk(now, len(event.token_ids))
        if event.finish_reason is None:
            return
        if event.usage is not None:
            record.prompt_len = event.usage.prompt_tokens
        error = None if event.finish_reason in ("stop", "length") else f"{event.finish_reason}: {event.error or ''}"
        record.finish(now, error)
        if not done.done():
            done.set_result(None)

    async def generate(self, request: GenerateRequest, record: RequestRecord) -> None:
        done = asyncio.get_running_loop().create_future()
        self._open[request.id] = (record, done)
        try:
            await self._nc.publish(subjects.GENERATE, encode_json(request), reply=f"{self._inbox}.{request.id}")
            await done
        except asyncio.CancelledError:  # timed out: free the server's slot too
            await self._nc.publish(subjects.ABORT, json.dumps({"id": request.id}).encode())
            raise
        finally:
            del self._open[request.id]


class HttpTarget:
    """OpenAI-compatible streaming completions, as `vllm bench serve --backend openai` sends them, with its
    client library (aiohttp). httpx, used here before, cost a lone stream 1.7 ms more time to first token
    against the same `orca serve` (median of five alternating rounds of 50 requests, 2026-12-05)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    async def __aenter__(self) -> HttpTarget:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=30.0),
                                              connector=aiohttp.TCPConnector(limit=0))  # no cap on connections
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def payload(self, request: GenerateRequest) -> dict:
        if request.messages is not None:
            raise ValueError("chat requests are not supported by the completions endpoint")
        body = {"prompt": request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt,
                "max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                "ignore_eos": request.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = request.stop
        if self.model:
            body["model"] = self.model
        return body

    async def generate(self, request: GenerateRequest, record: RequestRecord) -> None:
        usage = None
        finish_reason = None
        async with self._session.post(self.url, json=self.payload(request), headers=self.headers) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")[:300]
                record.finish(time.perf_counter(), f"HTTP {resp.status}: {body}")
                return
            async for raw in resp.content:  # one line at a time
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    record.finish(now, f"error event: {chunk['error']}")
                    return
                for choice in chunk.get("choices") or ():
                    if choice.get("text") or (choice.get("finish_reason") and not record.chunk_times):
                        record.add_chunk(now, 1)  # a request's text may all come with its last chunk
                    finish_reason = choice.get("finish_reason") or finish_reason
                usage = chunk.get("usage") or usage
        if usage:
            record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
            record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        error = None if finish_reason in ("stop", "length") else f"finish_reason={finish_reason}"
        record.finish(time.perf_counter(), error)


class InProcessTarget:
    """The in-process engine as a stepped target: no NATS, no Ray."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def add(self, request: GenerateRequest) -> int:
        prompt_ids = self.engine.prompt_ids(request)
        self.engine.add_request(request.id, prompt_ids, request.sampling_params())
        return len(prompt_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def step(self) -> list[StepEvent]:
        events = []
        for delta in self.engine.step():
            reason = delta.completion.finish_reason
            error = None
            if reason is not None and reason not in (FinishReason.STOP, FinishReason.LENGTH):
                error = f"{reason.label}: {delta.completion.error or ''}"
            events.append(StepEvent(delta.completion.request_id, len(delta.new_token_ids), reason is not None, error))
        return events

    def warm_up(self) -> None:
        """One short request, untimed: the first forward passes pay one-off costs."""
        self.engine.add_request("orca-bench-warmup", list(range(10, 74)),
                                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while self.engine.has_unfinished:
            self.engine.step()


def resolved_model(model: str | None) -> str:
    """--model, or the demo model `orca serve` uses (made on first use)."""
    if model:
        return os.path.expanduser(model)
    from services.serve import ensure_demo_model

    return ensure_demo_model()


def make_inprocess_target(config: EngineConfig) -> InProcessTarget:
    from engine.llm_engine import LLMEngine

    return InProcessTarget(LLMEngine(config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_serve(config: EngineConfig, threads: int | None = None,
                 timeout_s: float = 600.0) -> Iterator[tuple[str, str]]:
    """Run `orca serve` with the flags of `config` (its own NATS and Ray) and `threads` torch threads
    per worker (default: serve's); yield (http_url, nats_url)."""
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(_free_port()), *engine_argv(config)]
    if threads:
        cmd += ["--worker-threads", str(threads)]
    print(f"launching: {' '.join(cmd[1:])}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        while not (up := next((line for line in lines if "orca-serve is up" in line), None)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("orca serve did not start:\n" + "".join(lines[-30:]))
            time.sleep(0.2)
        http_url = re.search(r"HTTP (http://\S+?),", up).group(1)
        nats_url = re.search(r"nats://[\w.\-]+:\d+", up).group(0)
        yield http_url, nats_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def warm_up_streaming(target, request: GenerateRequest) -> None:
    """One short request through a server before timing (its first passes pay one-off costs). A server
    that cannot be reached, or fails the request, is a ValueError: one line for the CLI, before any run."""
    record = RequestRecord("warmup", time.perf_counter())
    try:
        await asyncio.wait_for(target.generate(request, record), 300)
    except Exception as exc:  # noqa: BLE001 - refused connection, timeout, broken stream: nothing to measure
        raise ValueError(f"the warm-up request failed ({type(exc).__name__}: {exc}); is the server up?") from None
    if record.error:
        raise ValueError(f"the warm-up request failed: {record.error}")
