"""Tokenizer service: the front door of `orca.v1.generate`.

It validates and tokenizes requests (prompt, token ids or chat messages), hands them to
admission, and turns the engine's per-iteration token outputs into JSON events on each
request's reply subject: incremental detokenization (no garbled multi-byte characters) and
stop strings (on a match it tells the engine to stop the request). Replicas share the load
through a queue group; each replica owns the requests it accepted.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from core.detokenize import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from services.tokenizer.telemetry import RequestTrace, TokenizerTelemetry
from shared import subjects
from shared.api import GenerateEvent, GenerateRequest, Usage, decode_generate_request, encode_json, event_logprobs
from shared.codec import Codec
from shared.messages import Cancel, IterationOutputs, TokenizedRequest
from shared.outputs import FinishReason, RequestOutput
from shared.telemetry import SnapshotPublisher

log = logging.getLogger("orca.tokenizer")
outputs_codec = Codec(IterationOutputs)


@dataclass
class ActiveRequest:
    reply: str
    detokenizer: IncrementalDetokenizer
    prompt_token_ids: list[int]
    num_generated: int = 0
    trace: RequestTrace | None = None


class TokenizerService:
    def __init__(self, nc: Client, tokenizer: Tokenizer, vocab_size: int, instance: str | None = None,
                 model_name: str = "orca") -> None:
        self.nc = nc
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.instance = instance or uuid.uuid4().hex[:12]
        self.active: dict[str, ActiveRequest] = {}
        self.telemetry = TokenizerTelemetry(model_name)
        self.metrics = SnapshotPublisher(nc, self.telemetry.snapshot)

    async def start(self) -> None:
        await self.nc.subscribe(subjects.GENERATE, queue=subjects.TOKENIZER_QUEUE, cb=self.on_generate)
        await self.nc.subscribe(subjects.detok(self.instance), cb=self.on_outputs)
        self.metrics.start()

    async def on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("generate request without a reply subject dropped")
            return
        arrival_ns = time.time_ns()
        try:
            request = decode_generate_request(msg.data)
            params = request.sampling_params()
            tokenize_start_ns = time.time_ns()
            prompt_ids = self.prompt_ids(request)
            tokenize_ns = (tokenize_start_ns, time.time_ns())
            if request.id in self.active:
                raise ValueError(f"request id {request.id!r} is already in use")
        except ValueError as exc:
            self.telemetry.on_reject(_id_of(msg.data), msg.headers, str(exc))
            await self._publish(msg.reply, GenerateEvent(_id_of(msg.data), [], "", "error", error=str(exc)))
            return
        trace = self.telemetry.on_accept(request, params, len(prompt_ids), msg.headers, arrival_ns, tokenize_ns)
        self.active[request.id] = ActiveRequest(
            msg.reply, IncrementalDetokenizer(self.tokenizer.decode, params.stop), prompt_ids, trace=trace)
        tokenized = TokenizedRequest(request.id, prompt_ids, params, self.instance, arrival_ns / 1e9, request.priority,
                                     trace_context=self.telemetry.traceparent(trace))
        await self.nc.publish(subjects.ADMISSION_SUBMIT, Codec.encode(tokenized))

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            bad = next((t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            return request.prompt_token_ids
        if request.messages is not None:
            return self.tokenizer.apply_chat_template([msgspec.structs.asdict(m) for m in request.messages])
        return self.tokenizer.encode(request.prompt or "")

    async def on_outputs(self, msg: Msg) -> None:
        for output in outputs_codec.decode(msg.data).outputs:
            await self._forward(output)

    async def _forward(self, output: RequestOutput) -> None:
        state = self.active.get(output.request_id)
        if state is None:
            return  # already ended here (e.g. a stop string matched before the engine knew)
        state.num_generated += len(output.new_token_ids)
        detokenize_start = time.perf_counter()
        text = state.detokenizer.add(output.new_token_ids)
        self.telemetry.on_output(state.trace, len(output.new_token_ids), time.perf_counter() - detokenize_start)
        reason = output.finish_reason
        if state.detokenizer.stopped and reason is None:
            reason = FinishReason.STOP
            await self.nc.publish(subjects.CANCEL, Codec.encode(Cancel(output.request_id, reason)))
        logprobs = event_logprobs(output.logprobs) if output.logprobs else None
        if reason is None:
            await self._publish(state.reply, GenerateEvent(output.request_id, list(output.new_token_ids), text, None,
                                                           logprobs=logprobs))
            return
        text += state.detokenizer.flush()
        del self.active[output.request_id]
        self.telemetry.on_final(state.trace, reason, len(state.prompt_token_ids), state.num_generated, output.error)
        await self._publish(state.reply, GenerateEvent(
            output.request_id, list(output.new_token_ids), text, reason.label, error=output.error,
            usage=Usage(len(state.prompt_token_ids), state.num_generated), prompt_token_ids=state.prompt_token_ids,
            logprobs=logprobs))

    async def _publish(self, subject: str, event: GenerateEvent) -> None:
        await self.nc.publish(subject, encode_json(event))


def _id_of(data: bytes) -> str | None:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return value.get("id") if isinstance(value, dict) and isinstance(value.get("id"), str) else None
