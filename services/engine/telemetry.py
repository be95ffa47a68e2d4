"""The engine master's telemetry: one span per iteration, one span per request while it is in this
engine, and the engine's metric snapshot. Kept apart from the loop so the master calls it in two
places only: `on_admit(requests)` when an Admit arrives, `on_iteration(...)` after each
`scheduler.update`.

Spans:
- `orca.iteration` (a root span per iteration, linked to the span of every request in its batch):
  batch size, prefill and decode tokens, KV blocks/slots used and free, policy, index, duration.
- `orca.engine.request` (a child of the request's span, whose traceparent travels in
  `TokenizedRequest.trace_context`): from admission into this engine until it leaves, with
  `scheduled` and `first_token` events.

With tracing off, `on_iteration` only updates a few counters and histograms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from core.batch import SchedulerOutput, StepResult
from core.scheduler import Scheduler
from shared.messages import EngineMetrics, TokenizedRequest
from shared.outputs import FinishReason, RequestOutput
from shared.telemetry import (BATCH_SIZE_BUCKETS, ITERATION_TOKEN_BUCKETS, LATENCY_BUCKETS, Histogram,
                              PhaseHistograms, SnapshotPublisher, TelemetryConfig, context_from_traceparent,
                              get_tracer, new_source_id, setup_tracing, span_context_of)


@dataclass
class TrackedRequest:
    arrival_time: float
    """Unix time the system accepted it (the queue time starts there)."""
    link: Link | None
    """To the request's own span, for the iteration spans that serve it."""
    span: Span | None
    scheduled_ns: int | None = None
    """When its first iteration here started (Unix ns); then when its first and its last token came."""
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    num_generated: int = 0
    """Tokens it made here."""


class EngineTelemetry:
    def __init__(self, nc: Client | None, replica: str, scheduler: Scheduler, *,
                 tracer: trace.Tracer | None = None, config: TelemetryConfig | None = None) -> None:
        """`nc` None: no snapshots are published. `tracer`: record with it (tests); otherwise the
        process's tracing is set up from `config` (default: the environment)."""
        config = config or TelemetryConfig.from_env()
        self.tracing = tracer is not None or setup_tracing("engine", config)
        self.tracer = tracer or get_tracer("orca.engine")
        self.replica = replica
        self.scheduler = scheduler
        self.source = new_source_id(f"engine{replica}")
        self.requests: dict[str, TrackedRequest] = {}
        self.iterations = 0
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)
        self.phases = PhaseHistograms()
        self.publisher = SnapshotPublisher(nc, self.snapshot, config.metrics_interval_s) if nc is not None else None
        self._start_publisher()  # now if built inside the event loop (the master is), else at the first hook


    # ---- hooks the master calls ------------------------------------------------------------------

    def on_admit(self, requests: list[TokenizedRequest]) -> None:
        self._start_publisher()
        for tokenized in requests:
            parent = context_from_traceparent(tokenized.trace_context)
            span_context = span_context_of(parent)
            span = None
            if self.tracing:
                span = self.tracer.start_span("orca.engine.request", context=parent, attributes={
                    "orca.request_id": tokenized.request_id, "orca.replica": self.replica,
                    "gen_ai.usage.input_tokens": len(tokenized.prompt_token_ids)})
            # no link attributes: the SDK copies them into every span that links (per iteration per request)
            link = Link(span_context) if span_context else None
            self.requests[tokenized.request_id] = TrackedRequest(tokenized.arrival_time, link, span)

    def on_iteration(self, output: SchedulerOutput, result: StepResult, events: list[RequestOutput],
                     started: float) -> None:
        """After `scheduler.update(output, result.output)` returned `events`; `started` is
        time.perf_counter() when the iteration was scheduled."""
        end_ns = time.time_ns()
        start_ns = end_ns - int((time.perf_counter() - started) * 1e9)
        self._start_publisher()
        self.iterations += 1
        self.iteration_tokens.observe(output.num_tokens)
        self.batch_size.observe(len(output.scheduled))
        links: list[Link] = []
        for item in output.scheduled:
            tracked = self.requests.get(item.request_id)
            if tracked is None:
                continue
            if tracked.link is not None:
                links.append(tracked.link)
            if tracked.scheduled_ns is None:
                tracked.scheduled_ns = start_ns
                self.queue_time.observe(max(0.0, start_ns / 1e9 - tracked.arrival_time))
                if tracked.span is not None:
                    tracked.span.add_event("scheduled", timestamp=start_ns)
        for event in events:
            tracked = self.requests.get(event.request_id)
            if tracked is None or not event.new_token_ids:
                continue
            if tracked.first_token_ns is None:
                tracked.first_token_ns = end_ns
                if tracked.span is not None:
                    tracked.span.add_event("first_token", timestamp=end_ns)
            tracked.last_token_ns = end_ns
            tracked.num_generated += len(event.new_token_ids)
        if self.tracing:
            self._iteration_span(output, result, links, start_ns, end_ns)
        self._end_finished(events, end_ns)

    # ---- spans ------------------------------------------------------------------------------------

    def _iteration_span(self, output: SchedulerOutput, result: StepResult, links: list[Link],
                        start_ns: int, end_ns: int) -> None:
        kv = self.scheduler.kv_cache
        used_slots, reserved_slots = self._slots()
        span = self.tracer.start_span("orca.iteration", context=_ROOT, kind=SpanKind.INTERNAL, links=links,
                                      start_time=start_ns, attributes={
            "orca.iteration.index": output.iteration,
            "orca.replica": self.replica,
            "orca.policy": self.scheduler.policy.name,
            "orca.batch_size": len(output.scheduled),
            "orca.num_prefill_tokens": output.num_prefill_tokens,
            "orca.num_decode_tokens": output.num_decode_tokens,
            "orca.num_tokens": output.num_tokens,
            "orca.num_new_requests": len(output.new_requests),
            "orca.num_preempted": len(output.preempted_request_ids),
            "orca.num_running": len(self.scheduler.running),
            "orca.num_waiting": len(self.scheduler.waiting),
            "orca.kv.used_blocks": kv.num_used_blocks,
            "orca.kv.free_blocks": kv.num_free_blocks,
            "orca.kv.reserved_slots": reserved_slots,
            "orca.kv.used_slots": used_slots,
            "orca.iteration.duration_s": (end_ns - start_ns) / 1e9,
            "orca.iteration.execute_s": result.execute_s,
        })
        span.end(end_time=end_ns)

    def on_finished(self, events: list[RequestOutput]) -> None:
        """Requests the engine ended, from an iteration or outside one (an abort, a cancel, a failed step)."""
        self._end_finished(events, time.time_ns())

    def _end_finished(self, events: list[RequestOutput], end_ns: int) -> None:
        for event in events:
            if event.finish_reason is not None:
                self._end(event.request_id, event.finish_reason.label, end_ns, event.error)
        if len(self.requests) != len(self.scheduler.requests):
            self.sweep(end_ns)

    def sweep(self, end_ns: int | None = None) -> None:
        """End what the scheduler no longer holds (cancelled, failed, or refused at admission)."""
        for request_id in [r for r in self.requests if r not in self.scheduler.requests]:
            self._end(request_id, "cancelled", end_ns or time.time_ns())

    def _end(self, request_id: str, reason: str, end_ns: int, error: str | None = None) -> None:
        tracked = self.requests.pop(request_id, None)
        if tracked is not None and reason != "cancelled":
            self._observe_phases(tracked)
        if tracked is not None and tracked.span is not None:
            tracked.span.set_attribute("orca.finish_reason", reason)
            if reason == FinishReason.ERROR.label:
                tracked.span.set_status(Status(StatusCode.ERROR, error or "error"))
            tracked.span.end(end_time=end_ns)

    # ---- metrics ----------------------------------------------------------------------------------

    def _observe_phases(self, tracked: TrackedRequest) -> None:
        """vLLM's request phases, for a request that ended here (not one moved away or cancelled) after
        its first token: prefill (first scheduled to first token), decode (to the last token), inference
        (both), and the decode time per token after the first."""
        if tracked.scheduled_ns is None or tracked.first_token_ns is None or tracked.last_token_ns is None:
            return
        self.phases.observe((tracked.first_token_ns - tracked.scheduled_ns) / 1e9,
                            (tracked.last_token_ns - tracked.first_token_ns) / 1e9, tracked.num_generated)

    def _slots(self) -> tuple[int, int]:
        """(slots holding computed tokens, slots in the blocks running requests hold)."""
        kv = self.scheduler.kv_cache
        used = sum(r.num_computed_tokens for r in self.scheduler.running)
        reserved = sum(len(kv.block_ids(r.request_id)) for r in self.scheduler.running) * kv.block_size
        return used, reserved

    def snapshot(self) -> EngineMetrics:
        self.sweep()  # also ends spans of requests cancelled while the engine idles
        s, kv = self.scheduler, self.scheduler.kv_cache
        used_slots, reserved_slots = self._slots()
        return EngineMetrics(
            source=self.source, replica=self.replica, policy=s.policy.name, num_running=len(s.running),
            num_waiting=len(s.waiting), max_num_seqs=s.max_num_seqs, num_blocks=kv.num_blocks,
            block_size=kv.block_size, kv_used_blocks=kv.num_used_blocks, kv_reserved_slots=reserved_slots,
            kv_used_slots=used_slots, num_preemptions=s.num_preemptions, iterations=self.iterations,
            request_queue_time=self.queue_time.data(), iteration_tokens=self.iteration_tokens.data(),
            batch_size=self.batch_size.data(), request_phases=self.phases.data(),
            prefix_cache_queries=s.prefix_queried_tokens, prefix_cache_hits=s.prefix_hit_tokens,
        )

    def _start_publisher(self) -> None:
        if self.publisher is not None:
            try:
                self.publisher.start()
            except RuntimeError:  # no running event loop yet
                pass


_ROOT = trace.set_span_in_context(trace.INVALID_SPAN)
"""Iteration spans start their own trace (they serve many requests; links tie them to each)."""
