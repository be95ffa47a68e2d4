"""EngineTelemetry against a real iteration scheduler: one span per iteration with the right
attributes and links, one engine span per request, and the metric snapshot's figures."""

from __future__ import annotations

import time

import pytest

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core.batch import StepResult
from core.request import Request
from services.engine.telemetry import EngineTelemetry
from shared.messages import TokenizedRequest
from shared.telemetry import TelemetryConfig, traceparent
from tests.core.helpers import fake_step, make_scheduler


def recording_tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def admit(scheduler, telemetry, tracer, specs: list[tuple[str, int, int]]) -> dict[str, object]:
    """Requests (id, prompt_len, max_tokens) with a request span each, as the master's on_admit adds them."""
    spans, batch = {}, []
    for rid, prompt_len, max_tokens in specs:
        span = tracer.start_span(f"text_completion {rid}")
        spans[rid] = span
        request = Request(rid, list(range(10, 10 + prompt_len)),
                          scheduler_params(max_tokens), eos_token_ids=(2,))
        batch.append(TokenizedRequest(rid, request.prompt_token_ids, request.params, "tok", time.time(),
                                      trace_context=traceparent(span)))
        scheduler.add_request(request)
    telemetry.on_admit(batch)
    return spans


def scheduler_params(max_tokens: int):
    from shared.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def step(scheduler, telemetry) -> tuple[object, list, dict]:
    started = time.perf_counter()
    out = scheduler.schedule()
    runner = fake_step(out)
    events = scheduler.update(out, runner)
    kv = {"used": scheduler.kv_cache.num_used_blocks, "free": scheduler.kv_cache.num_free_blocks,
          "used_slots": sum(r.num_computed_tokens for r in scheduler.running)}
    telemetry.on_iteration(out, StepResult(out.iteration, runner, execute_s=0.001), events, started)
    return out, events, kv


def test_one_span_per_iteration_linked_to_the_requests_it_served():
    tracer, exporter = recording_tracer()
    s = make_scheduler(num_blocks=40, max_num_seqs=2)
    telemetry = EngineTelemetry(None, "0", s, tracer=tracer)
    spans = admit(s, telemetry, tracer, [("a", 5, 3), ("b", 4, 6), ("c", 3, 2)])
    expected = []
    while s.has_unfinished:
        out, events, kv = step(s, telemetry)
        expected.append((out, kv))
        if out.iteration == 1:  # d arrives while a and b run
            spans.update(admit(s, telemetry, tracer, [("d", 2, 2)]))

    finished = exporter.get_finished_spans()
    iterations = sorted((x for x in finished if x.name == "orca.iteration"),
                        key=lambda x: x.attributes["orca.iteration.index"])
    assert len(iterations) == len(expected) >= 6
    for span, (out, kv) in zip(iterations, expected):
        a = span.attributes
        assert a["orca.iteration.index"] == out.iteration
        assert a["orca.batch_size"] == len(out.scheduled)
        assert a["orca.num_prefill_tokens"] == out.num_prefill_tokens
        assert a["orca.num_decode_tokens"] == out.num_decode_tokens
        assert a["orca.kv.used_blocks"] == kv["used"] and a["orca.kv.free_blocks"] == kv["free"]
        assert a["orca.kv.used_slots"] == kv["used_slots"]
        assert a["orca.policy"] == "orca"
        assert span.parent is None and span.end_time > span.start_time
        linked = {link.context.span_id for link in span.links}
        assert linked == {spans[item.request_id].get_span_context().span_id for item in out.scheduled}
    # the first iteration is two prefills (max_num_seqs=2): 5 + 4 tokens, no decode
    assert iterations[0].attributes["orca.num_prefill_tokens"] == 9
    assert iterations[0].attributes["orca.num_decode_tokens"] == 0

    engine_spans = {x.attributes["orca.request_id"]: x for x in finished if x.name == "orca.engine.request"}
    assert set(engine_spans) == {"a", "b", "c", "d"}
    for rid, span in engine_spans.items():
        assert span.parent.span_id == spans[rid].get_span_context().span_id
        assert span.context.trace_id == spans[rid].get_span_context().trace_id
        assert [e.name for e in span.events] == ["scheduled", "first_token"]
        assert span.attributes["orca.finish_reason"] == "length"
    assert not telemetry.requests


def test_snapshot_counts_and_kv_slots():
    s = make_scheduler(num_blocks=40, max_num_seqs=4)
    telemetry = EngineTelemetry(None, "r1", s, config=TelemetryConfig())  # tracing off
    assert not telemetry.tracing
    admit(s, telemetry, recording_tracer()[0], [("a", 5, 3), ("b", 4, 6)])
    out, _, _ = step(s, telemetry)
    snap = telemetry.snapshot()
    # Orca reserves prompt + max_tokens (block_size 1): 8 + 10; computed so far: the prompts
    assert snap.kv_reserved_slots == 18 and snap.kv_used_slots == 9
    assert snap.num_running == 2 and snap.kv_used_blocks == 18 and snap.replica == "r1"
    total_tokens, iterations, batch = out.num_tokens, 1, [len(out.scheduled)]
    while s.has_unfinished:
        out, _, _ = step(s, telemetry)
        total_tokens += out.num_tokens
        iterations += 1
        batch.append(len(out.scheduled))
    snap = telemetry.snapshot()
    assert snap.iterations == iterations
    assert snap.iteration_tokens.sum == total_tokens and sum(snap.iteration_tokens.counts) == iterations
    assert snap.batch_size.sum == sum(batch)
    assert sum(snap.request_queue_time.counts) == 2  # once per request
    assert snap.kv_used_blocks == snap.kv_reserved_slots == snap.kv_used_slots == snap.num_running == 0


def test_a_request_cancelled_between_iterations_ends_its_span():
    tracer, exporter = recording_tracer()
    s = make_scheduler(num_blocks=40)
    telemetry = EngineTelemetry(None, "0", s, tracer=tracer)
    admit(s, telemetry, tracer, [("a", 3, 10), ("b", 3, 2)])
    step(s, telemetry)
    s.abort("a")
    telemetry.snapshot()  # the once-a-second snapshot notices while the engine idles
    ended = {x.attributes["orca.request_id"]: x for x in exporter.get_finished_spans()
             if x.name == "orca.engine.request"}
    assert ended["a"].attributes["orca.finish_reason"] == "cancelled"
    assert "b" not in ended and set(telemetry.requests) == {"b"}


def test_an_abort_and_a_failed_step_end_their_spans_with_their_reason():
    """The master hands the events it publishes outside an iteration (an abort, a failed step) to the
    telemetry: the span says `abort`, or `error` with an error status, not `cancelled`."""
    from opentelemetry.trace import StatusCode

    from shared.outputs import FinishReason

    tracer, exporter = recording_tracer()
    s = make_scheduler(num_blocks=40)
    telemetry = EngineTelemetry(None, "0", s, tracer=tracer)
    admit(s, telemetry, tracer, [("a", 3, 10), ("b", 3, 10)])
    step(s, telemetry)
    telemetry.on_finished([s.finish("a", FinishReason.ABORT),
                           s.finish("b", FinishReason.ERROR, "engine 0 failed: rank 0: RuntimeError: boom")])
    ended = {x.attributes["orca.request_id"]: x for x in exporter.get_finished_spans()
             if x.name == "orca.engine.request"}
    assert ended["a"].attributes["orca.finish_reason"] == "abort" and ended["a"].status.status_code is StatusCode.UNSET
    assert ended["b"].attributes["orca.finish_reason"] == "error"
    assert ended["b"].status.status_code is StatusCode.ERROR and "boom" in ended["b"].status.description


class FakeClock:
    """time.time_ns and time.perf_counter of services.engine.telemetry, moved by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def time_ns(self) -> int:
        return int(self.now * 1e9)

    def perf_counter(self) -> float:
        return self.now


def test_request_phases_are_vllms_first_scheduled_to_first_and_last_token(monkeypatch):
    """vLLM's request_prefill/decode/inference_time_seconds and request_time_per_output_token_seconds, from
    each request's iterations: 10 ms steps 2 ms apart. a (3 tokens) and b (1 token) run from the first
    step; c, admitted after it, waits one step; d is cancelled and gives no phases."""
    import services.engine.telemetry as engine_telemetry

    clock = FakeClock()
    monkeypatch.setattr(engine_telemetry, "time", clock)
    s = make_scheduler(num_blocks=40, max_num_seqs=4)
    telemetry = EngineTelemetry(None, "0", s, config=TelemetryConfig())
    admit(s, telemetry, recording_tracer()[0], [("a", 5, 3), ("b", 4, 1), ("d", 3, 10)])

    def timed_step() -> None:
        started = clock.now
        out = s.schedule()
        runner = fake_step(out)
        events = s.update(out, runner)
        clock.now += 0.010
        telemetry.on_iteration(out, StepResult(out.iteration, runner, execute_s=0.010), events, started)
        clock.now += 0.002

    timed_step()
    admit(s, telemetry, recording_tracer()[0], [("c", 2, 2)])
    s.abort("d")
    while s.has_unfinished:
        timed_step()
    snap = telemetry.snapshot()
    # a: prefill 10 ms; tokens at 10, 22, 34 ms: decode 24, 12 a token. b: prefill 10, nothing after.
    # c: first scheduled at 12 ms, tokens at 22 and 34: prefill 10, decode 12.
    phases = snap.request_phases
    assert sum(phases.prefill.counts) == 3
    assert phases.prefill.sum == pytest.approx(0.030, abs=1e-6)
    assert phases.decode.sum == pytest.approx(0.024 + 0.012, abs=1e-6)
    assert phases.inference.sum == pytest.approx(0.034 + 0.010 + 0.022, abs=1e-6)
    assert sum(phases.time_per_output_token.counts) == 2  # b made one token
    assert phases.time_per_output_token.sum == pytest.approx(0.012 + 0.012, abs=1e-6)


def test_prefix_cache_queries_and_hits_count_tokens_once_per_admission():
    """vLLM's prefix_cache_queries and _hits: the tokens of each request admitted to run and those found
    cached. b does not fit beside a at first (4 blocks of 4 slots, 3 for each); once a's prompt is cached,
    b shares its first two full blocks (8 of b's 10 tokens) and fits. The failed try counts nothing."""
    s = make_scheduler(num_blocks=4, max_num_seqs=2, block_size=4, enable_prefix_caching=True)
    telemetry = EngineTelemetry(None, "0", s, config=TelemetryConfig())
    prompt = list(range(10, 20))
    for rid, tokens in (("a", prompt), ("b", prompt[:9] + [99])):
        s.add_request(Request(rid, tokens, scheduler_params(2), eos_token_ids=(2,)))
    out, _, _ = step(s, telemetry)
    assert [item.request_id for item in out.scheduled] == ["a"]
    while s.has_unfinished:
        step(s, telemetry)
    snap = telemetry.snapshot()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (20, 8)
