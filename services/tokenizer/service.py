"""Tokenizer service: the front door of `orca.v1.generate`.

It validates and tokenizes requests (prompt, token ids or chat messages), hands them to
admission, and turns the engine's per-iteration token outputs into JSON events on each
request's reply subject: incremental detokenization (no garbled multi-byte characters) and
stop strings (on a match it tells the engine to stop the request). Replicas share the load
through a queue group; each replica owns the requests it accepted.

Failures: it resumes or resubmits what a dead engine or admission held, publishes a heartbeat and
answers clients who ask whether it still holds their request (services/tokenizer/recovery.py).

Streams are coalesced, never delayed: the engine's messages land in an inbox that one writer task
drains. A request's outputs that piled up while the writer was busy leave in one event carrying
all their tokens (and a logprob per token); when the writer is idle, a lone token leaves at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from core.detokenize import IncrementalDetokenizer
from engine.tokenizer import Tokenizer, render_messages
from services.bus import on_reconnect
from services.tokenizer.recovery import Recovery, prime, reattach, resume_ids
from services.tokenizer.telemetry import RequestTrace, TokenizerTelemetry
from shared import subjects
from shared.api import (AbortRequest, GenerateEvent, GenerateRequest, Usage, decode_generate_request, encode_json,
                        event_logprobs)
from shared.codec import Codec
from shared.messages import Cancel, IterationOutputs, TokenizedRequest
from shared.outputs import FinishReason, RequestOutput, TokenLogprob
from shared.telemetry import SnapshotPublisher
from shared.tools import Tool, ToolCall, ToolChoice, effective_choice, parse_tool_calls

log = logging.getLogger("orca.tokenizer")
outputs_codec = Codec(IterationOutputs)

RECONNECT_GRACE_S = 2.0
"""After NATS comes back, wait this long before ending the interrupted requests: their clients
reconnect too (nats.py retries every 0.5-2 s) and must have their reply subjects back first."""
RECENT_SUBMISSIONS = 10_000
"""Submissions remembered for a 'no responders' answer (it comes within a round trip, if at all)."""
INTERRUPTED = "the message bus (NATS) restarted while this request ran; its output may be incomplete"
SHUTTING_DOWN = "this orca-serve instance is shutting down; retry later"


@dataclass
class Taken:
    """What one event of a request carries: the tokens of the outputs taken since its last event."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason | None = None
    error: str | None = None
    stop_string: bool = False
    """A stop string matched: the engine does not know yet that the request ended."""


def by_request(arrived: list[bytes]) -> dict[str, list[RequestOutput]]:
    """The outputs of several iterations' messages, per request in order (first arrival first)."""
    grouped: dict[str, list[RequestOutput]] = {}
    for data in arrived:
        for output in outputs_codec.decode(data).outputs:
            grouped.setdefault(output.request_id, []).append(output)
    return grouped


@dataclass
class ActiveRequest:
    reply: str
    detokenizer: IncrementalDetokenizer
    prompt_token_ids: list[int]
    num_generated: int = 0
    trace: RequestTrace | None = None
    tools: list[Tool] | None = None
    """With tools the model may call: the final event carries the calls read from the whole output."""
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_calls(self) -> list[ToolCall] | None:
        if not self.tools or effective_choice(self.tools, self.tool_choice) == "none":
            return None
        return parse_tool_calls(self.detokenizer.text, self.tools, self.tool_choice, self.parallel_tool_calls)[1] or None


class TokenizerService:
    def __init__(self, nc: Client, tokenizer: Tokenizer, vocab_size: int, instance: str | None = None,
                 model_name: str = "orca") -> None:
        self.nc = nc
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.instance = instance or uuid.uuid4().hex[:12]
        self.active: dict[str, ActiveRequest] = {}
        # Submissions carry a reply subject only so that NATS answers "no responders" when no
        # admission service listens (it restarts, or NATS just did): the request then waits for one.
        self.bounce_inbox = nc.new_inbox()
        self.submissions: OrderedDict[str, str] = OrderedDict()  # token in the reply subject -> request id
        self._submission_ids = itertools.count()
        self.draining = False
        self._tasks: set[asyncio.Task] = set()
        self._arrived: list[bytes] = []  # engine messages the writer has not taken yet
        self._wakeup = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self.telemetry = TokenizerTelemetry(model_name)
        self.metrics = SnapshotPublisher(nc, self.telemetry.snapshot)
        self.recovery = Recovery(self)

    async def start(self) -> None:
        await self.nc.subscribe(subjects.GENERATE, queue=subjects.TOKENIZER_QUEUE, cb=self.on_generate)
        await self.nc.subscribe(subjects.detok(self.instance), cb=self.on_outputs)
        await self.nc.subscribe(f"{self.bounce_inbox}.*", cb=self.on_bounce)
        on_reconnect(self.nc, self.on_reconnected)
        await self.recovery.start()
        self._writer = asyncio.get_running_loop().create_task(self._write_events())
        self.metrics.start()

    async def on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("generate request without a reply subject dropped")
            return
        if self.draining:
            await self._publish(msg.reply, GenerateEvent(_id_of(msg.data), [], "", "error", error=SHUTTING_DOWN))
            return
        arrival_ns = time.time_ns()
        try:
            request = decode_generate_request(msg.data)
            params = request.sampling_params()
            tokenize_start_ns = time.time_ns()
            prompt_ids = self.prompt_ids(request)
            tokenize_ns = (tokenize_start_ns, time.time_ns())
            if request.id in self.active and request.resume_token_ids is not None:
                reattach(self.active[request.id], msg.reply)  # its client took this instance for gone
                return
            if request.id in self.active:
                raise ValueError(f"request id {request.id!r} is already in use")
            resumed = resume_ids(request, self.vocab_size)
        except ValueError as exc:
            self.telemetry.on_reject(_id_of(msg.data), msg.headers, str(exc))
            await self._publish(msg.reply, GenerateEvent(_id_of(msg.data), [], "", "error", error=str(exc)))
            return
        trace = self.telemetry.on_accept(request, params, len(prompt_ids), msg.headers, arrival_ns, tokenize_ns)
        state = self.active[request.id] = ActiveRequest(
            msg.reply, IncrementalDetokenizer(self.tokenizer.decode, params.stop), prompt_ids, trace=trace,
            tools=request.tools, tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls)
        prime(state, resumed)
        tokenized = TokenizedRequest(request.id, prompt_ids, params, self.instance, arrival_ns / 1e9, request.priority,
                                     trace_context=self.telemetry.traceparent(trace), resume_token_ids=resumed)
        await self._submit(tokenized)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            bad = next((t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            return request.prompt_token_ids
        if request.messages is not None:
            return render_messages(self.tokenizer, request)
        return self.tokenizer.encode(request.prompt or "")

    async def on_outputs(self, msg: Msg) -> None:
        """An engine message: into the inbox, for the writer (which may be busy writing)."""
        self._arrived.append(msg.data)
        self._wakeup.set()

    async def _write_events(self) -> None:
        """The writer: takes everything in the inbox, writes one event per request, and waits only
        when the inbox is empty (no timer: a lone token leaves as soon as it arrives)."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            arrived, self._arrived = self._arrived, []
            for request_id, outputs in by_request(arrived).items():
                try:
                    await self._forward(request_id, outputs)
                except Exception:  # noqa: BLE001 - one request's failure must not stop the others' streams
                    log.exception("could not forward the outputs of %s", request_id)

    async def _forward(self, request_id: str, outputs: list[RequestOutput]) -> None:
        state = self.active.get(request_id)
        if state is None:
            return  # already ended here (e.g. a stop string matched before the engine knew)
        taken = self._take(state, outputs)
        if taken.stop_string:
            await self.nc.publish(subjects.CANCEL, Codec.encode(Cancel(request_id, FinishReason.STOP)))
        logprobs = event_logprobs(taken.logprobs) if taken.logprobs else None
        if taken.reason is None:
            await self._publish(state.reply, GenerateEvent(request_id, taken.token_ids, taken.text, None,
                                                           logprobs=logprobs))
            return
        del self.active[request_id]
        self.telemetry.on_final(state.trace, taken.reason, len(state.prompt_token_ids), state.num_generated,
                                taken.error)
        text = taken.text + state.detokenizer.flush()
        tool_calls = state.tool_calls() if taken.reason != FinishReason.ERROR else None
        await self._publish(state.reply, GenerateEvent(
            request_id, taken.token_ids, text, taken.reason.label,
            error=taken.error, usage=Usage(len(state.prompt_token_ids), state.num_generated),
            prompt_token_ids=state.prompt_token_ids, logprobs=logprobs, tool_calls=tool_calls))

    def _take(self, state: ActiveRequest, outputs: list[RequestOutput]) -> Taken:
        """Detokenize `outputs` in order, each as if it had come alone (same text, same metrics), up
        to the first that ends the request: the engine's last output, or a stop string's match."""
        taken = Taken()
        for output in outputs:
            start = time.perf_counter()
            taken.text += state.detokenizer.add(output.new_token_ids)
            self.telemetry.on_output(state.trace, len(output.new_token_ids), time.perf_counter() - start)
            state.num_generated += len(output.new_token_ids)
            taken.token_ids += output.new_token_ids
            taken.logprobs += output.logprobs or ()
            if output.finish_reason is not None:
                taken.reason, taken.error = output.finish_reason, output.error
                break
            if state.detokenizer.stopped:
                taken.reason, taken.stop_string = FinishReason.STOP, True
                break
        return taken

    async def _publish(self, subject: str, event: GenerateEvent) -> None:
        await self.nc.publish(subject, encode_json(event))

    # ---- failures: admission away, NATS restarted, shutting down -------------------------------

    async def _submit(self, tokenized: TokenizedRequest) -> None:
        self.recovery.submitted(tokenized)
        token = str(next(self._submission_ids))
        self.submissions[token] = tokenized.request_id
        while len(self.submissions) > RECENT_SUBMISSIONS:
            self.submissions.popitem(last=False)
        await self.nc.publish(subjects.ADMISSION_SUBMIT, Codec.encode(tokenized), reply=f"{self.bounce_inbox}.{token}")

    async def on_bounce(self, msg: Msg) -> None:
        """NATS' 503 "no responders" to a submission: no admission service received it (one is
        restarting, say). It is sent again when an admission speaks, or ends after a timeout."""
        request_id = self.submissions.pop(msg.subject.rsplit(".", 1)[-1], None)
        if request_id is not None and request_id in self.active:
            self.recovery.bounced(request_id)

    def on_reconnected(self) -> None:
        """Engine outputs sent to this instance while NATS was away are lost, so no request in flight
        can be trusted to finish whole: each ends with an error event (never a silently cut output),
        after a grace period that lets its client resubscribe, and is aborted to free its KV."""
        interrupted = list(self.active.items())
        self.active.clear()
        if interrupted:
            log.warning("NATS reconnected: ending %d interrupted requests with an error", len(interrupted))
            task = asyncio.get_running_loop().create_task(self._end_later(interrupted))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _end_later(self, interrupted: list[tuple[str, ActiveRequest]]) -> None:
        await asyncio.sleep(RECONNECT_GRACE_S)
        for request_id, state in interrupted:
            await self._end_with_error(request_id, state, INTERRUPTED)

    async def drain(self, timeout_s: float) -> None:
        """Stop gracefully: refuse new requests (an error event says why), let those in flight finish
        for up to `timeout_s`, then end the rest with an error."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id, state in list(self.active.items()):
            del self.active[request_id]
            await self._end_with_error(request_id, state, SHUTTING_DOWN)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stop_writer()
        await self.nc.flush(timeout=5)

    async def stop_writer(self) -> None:
        """No request is left to write for (after a drain, or in a test)."""
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    async def _end_with_error(self, request_id: str, state: ActiveRequest, error: str) -> None:
        """The final event of a request this instance gives up on (the caller removed it from
        `active`); the abort frees whatever admission or an engine still holds of it."""
        self.telemetry.on_final(state.trace, FinishReason.ERROR, len(state.prompt_token_ids), state.num_generated,
                                error)
        await self.nc.publish(subjects.ABORT, encode_json(AbortRequest(request_id)))
        await self._publish(state.reply, GenerateEvent(
            request_id, [], state.detokenizer.flush(), "error", error=error,
            usage=Usage(len(state.prompt_token_ids), state.num_generated), prompt_token_ids=state.prompt_token_ids))


def _id_of(data: bytes) -> str | None:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return value.get("id") if isinstance(value, dict) and isinstance(value.get("id"), str) else None
