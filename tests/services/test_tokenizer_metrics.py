"""What the tokenizer counts for /metrics (vllm:prompt_tokens_total, request_success_total, the e2e
histogram), with an in-memory NATS connection: a prompt counts once an engine has read it (its first
token came), and a request refused before any token for a cause that passes (a full queue) is a
rejection, not a finished request, so an overload does not pull the latency percentiles down."""

from __future__ import annotations

import asyncio
import time

from shared.outputs import FinishReason, RequestOutput
from tests.services.test_tokenizer_coalescing import iteration, settle, started


def final_counts(*outputs: RequestOutput) -> tuple[int, int, dict, int]:
    async def go():
        service, nc = await started()
        for output in outputs:
            await service.on_outputs(iteration(output))
            await settle()
        await service.stop_writer()
        t = service.telemetry
        return t.prompt_tokens, t.generation_tokens, dict(t.finished), sum(t.e2e.counts)
    return asyncio.run(go())


def test_a_served_request_counts_its_prompt_tokens_and_its_end():
    counts = final_counts(RequestOutput("r1", (7,)), RequestOutput("r1", (8,), finish_reason=FinishReason.LENGTH))
    assert counts == (3, 2, {FinishReason.LENGTH: 1}, 1)


def test_request_histograms_take_served_requests_only_and_add_up_to_the_counters():
    """vLLM's request_prompt_tokens, request_generation_tokens and request_params_max_tokens: one sample per
    request the engine read (so their sums equal prompt_tokens_total and generation_tokens_total, as in
    vLLM); none for one that failed before its first token, nor a max_tokens sample for one that set none."""
    async def go(body: dict | None, *outputs: RequestOutput):
        service, nc = await started(body)
        for output in outputs:
            await service.on_outputs(iteration(output))
            await settle()
        await service.stop_writer()
        t = service.telemetry
        sizes = t.sizes
        return [(h.sum, sum(h.counts)) for h in (sizes.prompt_tokens, sizes.generation_tokens, sizes.max_tokens)]

    served = (RequestOutput("r1", (7,)), RequestOutput("r1", (8, 9), finish_reason=FinishReason.LENGTH))
    assert asyncio.run(go(None, *served)) == [(3, 1), (3, 1), (8, 1)]
    assert asyncio.run(go({"max_tokens": None}, *served)) == [(3, 1), (3, 1), (0, 0)]
    failed = RequestOutput("r1", finish_reason=FinishReason.ERROR, error="engine 0 failed: rank 0: RuntimeError")
    assert asyncio.run(go(None, failed)) == [(0, 0)] * 3


def test_a_request_refused_by_a_full_queue_is_no_finished_request():
    refused = RequestOutput("r1", finish_reason=FinishReason.ERROR, error="the admission queue is full", retry=True)
    assert final_counts(refused) == (0, 0, {}, 0)


def test_a_request_that_failed_before_its_first_token_is_an_error_without_prompt_tokens():
    failed = RequestOutput("r1", finish_reason=FinishReason.ERROR, error="engine 0 failed: rank 0: RuntimeError")
    assert final_counts(failed) == (0, 0, {FinishReason.ERROR: 1}, 1)


def test_an_invalid_request_in_no_trace_and_with_no_id_opens_no_error_span():
    """`orca serve`'s readiness probe sends `{}`: no span (every deployment's traces began with an error);
    an invalid request with an id, or inside a caller's trace, still gets its error span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.tokenizer.telemetry import TokenizerTelemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = TokenizerTelemetry("m")
    telemetry.tracing, telemetry.tracer = True, provider.get_tracer("test")
    telemetry.on_reject(None, None, "give exactly one of prompt, prompt_token_ids or messages")
    assert exporter.get_finished_spans() == ()
    telemetry.on_reject("r1", None, "prompt is empty")
    telemetry.on_reject(None, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, "malformed JSON")
    assert [s.name for s in exporter.get_finished_spans()] == ["orca.request.invalid"] * 2


def test_a_request_span_names_what_the_client_called():
    """A chat the gateway rendered arrives as token ids with operation "chat"; without it, messages are a chat
    and a prompt a text completion (OpenTelemetry's gen_ai.operation.name)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared.api import ChatMessage, GenerateRequest
    from services.tokenizer.telemetry import TokenizerTelemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = TokenizerTelemetry("m")
    telemetry.tracing, telemetry.tracer = True, provider.get_tracer("test")
    requests = [GenerateRequest(id="a", prompt_token_ids=[1, 2], operation="chat"),
                GenerateRequest(id="b", prompt_token_ids=[1, 2]),
                GenerateRequest(id="c", messages=[ChatMessage(role="user", content="hi")]),
                GenerateRequest(id="d", prompt="hi", operation="text_completion")]
    for request in requests:
        trace = telemetry.on_accept(request, request.sampling_params(), 2, None, time.time_ns(), (0, 1))
        trace.span.end()
    spans = [s for s in exporter.get_finished_spans() if s.name != "tokenize"]
    assert [(s.name, s.attributes["gen_ai.operation.name"]) for s in spans] == [
        ("chat m", "chat"), ("text_completion m", "text_completion"), ("chat m", "chat"),
        ("text_completion m", "text_completion")]


def test_a_draining_tokenizer_says_so_at_once():
    """/health must stop saying ok when new requests start being refused, not a heartbeat later."""
    from shared import subjects
    from shared.codec import Codec
    from shared.messages import TokenizerStatus

    async def go():
        service, nc = await started()
        await service.on_outputs(iteration(RequestOutput("r1", (7,), finish_reason=FinishReason.LENGTH)))
        await settle()
        await service.drain(timeout_s=0.0)
        return [Codec(TokenizerStatus).decode(d) for d in nc.on(subjects.TOKENIZER_STATUS)]
    assert [s.draining for s in asyncio.run(go())] == [True]
