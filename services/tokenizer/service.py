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

Nothing is lost when NATS goes away for a while (a restart, a failover between cluster nodes):
both streams through this service are numbered (core/streams.py). The engine's messages to this
instance carry a sequence per engine: a gap, or a reconnect, makes it ask that engine for the rest
(`OutputsReplay`). Its own events carry `seq` per request, and each request's events are kept
until REPLAY_WINDOW_S after its last, so a client that missed some asks for them again
(`orca.v1.generate.replay`).
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
from nats.aio.msg import Msg

from core.detokenize import IncrementalDetokenizer
from core.streams import Arrival, ReplayLog, arrival
from engine.tokenizer import Tokenizer, render_messages
from shared.client import NoAnswer, ask
from services.bus import Bus, on_reconnect
from services.tokenizer.recovery import Recovery, prime, reattach, resume_ids
from services.tokenizer.telemetry import RequestTrace, TokenizerTelemetry
from shared import subjects
from shared.api import (AbortRequest, GenerateEvent, GenerateRequest, ReplayReply, Usage, decode_generate_request,
                        decode_replay, encode_json, event_logprobs)
from shared.codec import Codec
from shared.messages import Cancel, IterationOutputs, OutputsReplay, OutputsReplayed, TokenizedRequest
from shared.outputs import FinishReason, RequestOutput, TokenLogprob
from shared.telemetry import SnapshotPublisher
from shared.tools import Tool, ToolCall, ToolChoice, effective_choice, parse_tool_calls

log = logging.getLogger("orca.tokenizer")
outputs_codec, replayed_codec = Codec(IterationOutputs), Codec(OutputsReplayed)

REPLAY_WINDOW_S = 30.0
"""A request's events are kept this long after its last one, for a client that asks them again."""
MAX_ENDED_KEPT = 10_000
REPLAY_RETRY_S = 0.2
REPLAY_GIVE_UP_S = 30.0
"""An engine asked for missing outputs this long without an answer is left to the recovery rules
(an engine silent that long has expired: its requests resume elsewhere)."""
OUTPUTS_LOST = "the engine no longer had this request's outputs sent while the message bus (NATS) was away"
RECENT_SUBMISSIONS = 10_000
"""Submissions remembered for a 'no responders' answer (it comes within a round trip, if at all)."""
SHUTTING_DOWN = "this orca-serve instance is shutting down; retry later"
LARGE_PROMPT_CHARS = 65_536
"""A prompt this long is tokenized off the event loop: a 7 MB one took seconds there, and every stream
this instance serves waited (1.4 s between two events of another stream with a 1 MB prompt beside it)."""


@dataclass
class Taken:
    """What one event of a request carries: the tokens of the outputs taken since its last event."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """With the first token of a request that asked for them."""
    reason: FinishReason | None = None
    error: str | None = None
    retry: bool = False
    stop_string: bool = False
    """A stop string matched before the engine ended the request: it does not know yet (a Cancel tells it)."""


def by_request(arrived: list[IterationOutputs]) -> dict[str, list[RequestOutput]]:
    """The outputs of several iterations' messages, per request in order (first arrival first)."""
    grouped: dict[str, list[RequestOutput]] = {}
    for message in arrived:
        for output in message.outputs:
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
    events: ReplayLog = field(default_factory=ReplayLog)
    """Every event sent so far (encoded), numbered from the request's `resume_seq`."""
    ended_at: float | None = None

    def tool_calls(self) -> list[ToolCall] | None:
        if not self.tools or effective_choice(self.tools, self.tool_choice) == "none":
            return None
        return parse_tool_calls(self.detokenizer.text, self.tools, self.tool_choice, self.parallel_tool_calls)[1] or None


class TokenizerService:
    def __init__(self, nc: Bus, tokenizer: Tokenizer, vocab_size: int, instance: str | None = None,
                 model_name: str = "orca") -> None:
        self.nc = nc
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.instance = instance or uuid.uuid4().hex[:12]
        self.active: dict[str, ActiveRequest] = {}
        self.ended: OrderedDict[str, ActiveRequest] = OrderedDict()
        """Requests that sent their last event, kept REPLAY_WINDOW_S for replays."""
        self.next_from: dict[str, int] = {}
        """Per engine source: the seq of the next message expected from it."""
        self._replaying: set[str] = set()
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
        await self.nc.subscribe(subjects.GENERATE_REPLAY, cb=self.on_replay)
        on_reconnect(self.nc, self.on_reconnected)
        await self.recovery.start()
        self._writer = asyncio.get_running_loop().create_task(self._write_events())
        self.metrics.start()

    async def on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("generate request without a reply subject dropped")
            return
        if self.draining:
            await self._refuse(msg, SHUTTING_DOWN, retry=True)
            return
        arrival_ns = time.time_ns()
        try:
            request = decode_generate_request(msg.data)
            params = request.sampling_params()
            params.check_vocabulary(self.vocab_size)
            tokenize_start_ns = time.time_ns()
            if _prompt_chars(request) > LARGE_PROMPT_CHARS:
                prompt_ids = await asyncio.to_thread(self.prompt_ids, request)
            else:
                prompt_ids = self.prompt_ids(request)
            tokenize_ns = (tokenize_start_ns, time.time_ns())
            held = self.active.get(request.id)
            # A resend of the same request: its client took this instance for gone. Not another request
            # under the same id: that would take the stream over (ids are the users' own).
            if held is not None and request.resume_token_ids is not None and held.prompt_token_ids == prompt_ids:
                reattach(held, msg.reply)
                return
            if held is not None:
                raise ValueError(f"request id {request.id!r} is already in use")
            resumed = resume_ids(request, self.vocab_size)
        except ValueError as exc:
            self.telemetry.on_reject(_stream_of(msg.data)[0], msg.headers, str(exc))
            await self._refuse(msg, str(exc))
            return
        trace = self.telemetry.on_accept(request, params, len(prompt_ids), msg.headers, arrival_ns, tokenize_ns)
        self.ended.pop(request.id, None)
        detokenizer = IncrementalDetokenizer.of(self.tokenizer.decode, params, self.tokenizer.eos_token_ids)
        state = self.active[request.id] = ActiveRequest(
            msg.reply, detokenizer, prompt_ids, trace=trace,
            tools=request.tools, tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
            events=ReplayLog(first_seq=request.resume_seq))
        prime(state, resumed)
        tokenized = TokenizedRequest(request.id, prompt_ids, params, self.instance, arrival_ns / 1e9, request.priority,
                                     trace_context=self.telemetry.traceparent(trace), resume_token_ids=resumed,
                                     cache_salt=request.cache_salt)
        await self._submit(tokenized)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids (in a worker thread for a long prompt: the tokenizer drops the GIL)."""
        if request.prompt_token_ids is not None:
            bad = next((t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            return request.prompt_token_ids
        if request.messages is not None:
            return render_messages(self.tokenizer, request)
        return self.tokenizer.encode(request.prompt or "")

    async def on_outputs(self, msg: Msg) -> None:
        """An engine message: into the inbox, for the writer (which may be busy writing), if it is
        the next of its engine's stream."""
        message = outputs_codec.decode(msg.data)
        if message.source:
            placements = self.recovery.placements
            copies = message.copies or [None] * len(message.outputs)
            kept = [o for o, copy in zip(message.outputs, copies)
                    if placements.output_from(o.request_id, message.source, copy)]
            if len(kept) < len(message.outputs):
                message = msgspec.structs.replace(message, outputs=kept, copies=[])
        if message.seq >= 0:
            seen = arrival(self.next_from.get(message.source, 0), message.seq)
            if seen is Arrival.REPEAT:
                return
            if seen is Arrival.GAP:
                self.replay_from(message.source)
                return
            self.next_from[message.source] = message.seq + 1
        self._arrived.append(message)
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
        prompt_logprobs = event_logprobs(taken.prompt_logprobs) if taken.prompt_logprobs is not None else None
        if taken.reason is None:
            await self._publish_event(state, GenerateEvent(request_id, taken.token_ids, taken.text, None,
                                                           logprobs=logprobs, prompt_logprobs=prompt_logprobs))
            return
        self._ended(request_id, state)
        self.telemetry.on_final(state.trace, taken.reason, len(state.prompt_token_ids), state.num_generated,
                                taken.error, taken.retry)
        text = taken.text + state.detokenizer.flush()
        tool_calls = state.tool_calls() if taken.reason != FinishReason.ERROR else None
        failed = taken.reason == FinishReason.ERROR
        await self._publish_event(state, GenerateEvent(
            request_id, taken.token_ids, text, taken.reason.label,
            error=taken.error, usage=Usage(len(state.prompt_token_ids), state.num_generated),
            # not on an error: the prompt may be what was wrong (millions of ids, past NATS's max_payload)
            prompt_token_ids=None if failed else state.prompt_token_ids, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, tool_calls=tool_calls,
            stop_reason=state.detokenizer.stop_reason if taken.reason is FinishReason.STOP else None,
            retry=taken.retry))

    def _take(self, state: ActiveRequest, outputs: list[RequestOutput]) -> Taken:
        """Detokenize `outputs` in order, each as if it had come alone (same text, same metrics), up
        to the first that ends the request: the engine's last output, or a stop string's match."""
        taken = Taken()
        for output in outputs:
            start = time.perf_counter()
            text, n = state.detokenizer.add_output(output.new_token_ids, output.finish_reason is FinishReason.STOP)
            taken.text += text
            self.telemetry.on_output(state.trace, n, time.perf_counter() - start)
            state.num_generated += n
            taken.token_ids += output.new_token_ids[:n]
            taken.logprobs += (output.logprobs or ())[:n]
            if output.prompt_logprobs is not None:
                taken.prompt_logprobs = output.prompt_logprobs
            # A stop string that completes on the last token max_tokens allows still ends the text: stop.
            if state.detokenizer.stopped and output.finish_reason in (None, FinishReason.LENGTH):
                taken.reason, taken.stop_string = FinishReason.STOP, output.finish_reason is None
                break
            if output.finish_reason is not None:
                taken.reason, taken.error, taken.retry = output.finish_reason, output.error, output.retry
                break
        return taken

    async def _refuse(self, msg: Msg, error: str, retry: bool = False) -> None:
        """A request refused at the door: its one event, numbered as the client expects next."""
        request_id, seq = _stream_of(msg.data)
        await self.nc.publish(msg.reply, encode_json(GenerateEvent(request_id, [], "", "error", error=error, seq=seq,
                                                                   retry=retry)))

    async def _publish_event(self, state: ActiveRequest, event: GenerateEvent) -> None:
        """The next event of a request's stream: numbered, kept for replays, sent."""
        data = encode_json(msgspec.structs.replace(event, seq=state.events.next_seq))
        state.events.append(data)
        await self.nc.publish(state.reply, data)

    def _ended(self, request_id: str, state: ActiveRequest) -> None:
        """A request sends its last event: no longer active, kept a while for replays."""
        self.active.pop(request_id, None)
        now = time.monotonic()
        state.ended_at = now
        self.ended[request_id] = state
        while self.ended and (len(self.ended) > MAX_ENDED_KEPT
                              or now - next(iter(self.ended.values())).ended_at > REPLAY_WINDOW_S):
            self.ended.popitem(last=False)

    # ---- replays: a client that missed events; events this instance missed -------------------------

    async def on_replay(self, msg: Msg) -> None:
        """A client asks for a request's events from a seq on: they go to its reply subject again, then
        the answer. An instance that does not hold the request says nothing."""
        try:
            replay = decode_replay(msg.data)
        except ValueError:
            return
        state = self.active.get(replay.id) or self.ended.get(replay.id)
        if state is None:
            return
        for data in state.events.since(max(replay.from_seq, 0)) or ():
            await self.nc.publish(state.reply, data)
        if msg.reply:
            await self.nc.publish(msg.reply, encode_json(ReplayReply(replay.id, True, state.events.next_seq)))

    def replay_from(self, source: str) -> None:
        """Ask the engine `source` for its messages from the first one missing (once at a time)."""
        if source in self._replaying or not source:
            return
        self._replaying.add(source)
        task = asyncio.get_running_loop().create_task(self._replay(source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replay(self, source: str) -> None:
        replica, incarnation = source.split("/", 1)
        deadline = time.monotonic() + REPLAY_GIVE_UP_S
        try:
            while time.monotonic() < deadline and self._waits_on(source):
                ask_for = OutputsReplay(self.instance, incarnation, self.next_from.get(source, 0))
                try:
                    answer = replayed_codec.decode((await ask(self.nc, subjects.engine_replay(replica),
                                                              Codec.encode(ask_for), timeout_s=1.0)).data)
                except NoAnswer:
                    await asyncio.sleep(REPLAY_RETRY_S)
                    continue
                log.info("engine %s sent again its outputs from %d to %d", source, ask_for.from_seq, answer.next_seq)
                if not answer.ok:
                    await self._outputs_lost(source)
                return
            log.warning("engine %s did not replay its outputs within %.0f s", source, REPLAY_GIVE_UP_S)
        finally:
            self._replaying.discard(source)

    def _waits_on(self, source: str) -> bool:
        return any(self.recovery.placements.engine_of(r) == source for r in self.active)

    async def _outputs_lost(self, source: str) -> None:
        """The engine no longer keeps what this instance missed (away longer than its window)."""
        lost = [r for r in self.active if self.recovery.placements.engine_of(r) == source]
        log.error("engine %s no longer has the outputs of %d requests sent while NATS was away", source, len(lost))
        for request_id in lost:
            state = self.active.pop(request_id)
            await self._end_with_error(request_id, state, OUTPUTS_LOST, retry=True)

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
        """Engine messages sent here while NATS was away may be lost: ask every engine that holds a
        request of this instance for its messages from the first not received (the clients ask this
        instance for the events they missed the same way), and submit again what no engine is known
        to hold. The engines' heartbeats it missed meanwhile say nothing of them: it judges them afresh."""
        self.recovery.reconnected()
        sources = {self.recovery.placements.engine_of(r) for r in self.active}
        for source in sources - {None}:
            self.replay_from(source)
        task = asyncio.get_running_loop().create_task(self.recovery.resubmit_unplaced())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float, cut_short: asyncio.Event | None = None) -> None:
        """Stop gracefully: refuse new requests (an error event says why), let those in flight finish
        for up to `timeout_s` (or until `cut_short` is set), then end the rest with an error."""
        self.draining = True
        try:  # gateways' /health stops saying ok now, not at the next heartbeat
            await self.recovery.publish_status()
        except Exception:  # noqa: BLE001 - NATS away: the heartbeat would have been lost as well
            log.warning("tokenizer: could not tell the gateways it drains")
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline and not (cut_short and cut_short.is_set()):
            await asyncio.sleep(0.05)
        for request_id, state in list(self.active.items()):
            del self.active[request_id]
            await self._end_with_error(request_id, state, SHUTTING_DOWN, retry=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stop_writer()
        await self.nc.flush(timeout=5)

    async def stop_writer(self) -> None:
        """No request is left to write for (after a drain, or in a test)."""
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    async def _end_with_error(self, request_id: str, state: ActiveRequest, error: str, retry: bool = False) -> None:
        """The final event of a request this instance gives up on (the caller removed it from
        `active`); the abort frees whatever admission or an engine still holds of it."""
        self.telemetry.on_final(state.trace, FinishReason.ERROR, len(state.prompt_token_ids), state.num_generated,
                                error, retry)
        self._ended(request_id, state)
        await self.nc.publish(subjects.ABORT, encode_json(AbortRequest(request_id)))
        await self._publish_event(state, GenerateEvent(
            request_id, [], state.detokenizer.flush(), "error", error=error,
            usage=Usage(len(state.prompt_token_ids), state.num_generated), retry=retry))


def _prompt_chars(request: GenerateRequest) -> int:
    """About how much text the request has to tokenize."""
    if request.prompt is not None:
        return len(request.prompt)
    return sum(len(m.content) for m in request.messages or () if isinstance(m.content, str))


def _stream_of(data: bytes) -> tuple[str | None, int]:
    """The id and `resume_seq` of a request that may not parse."""
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None, 0
    if not isinstance(value, dict):
        return None, 0
    request_id, seq = value.get("id"), value.get("resume_seq")
    return (request_id if isinstance(request_id, str) else None,
            seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0)
