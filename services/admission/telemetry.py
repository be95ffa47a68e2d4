"""Admission's telemetry: an `orca.admission.queue` span per request (a child of the request's span,
from submission until an engine gets it or it ends here) and the admission counters."""

from __future__ import annotations

from opentelemetry.trace import Span, Status, StatusCode

from core.admission import AdmissionQueue, QueueFull
from shared.messages import AdmissionMetrics, TokenizedRequest
from shared.outputs import FinishReason
from shared.telemetry import ServiceTelemetry, context_from_traceparent


class AdmissionTelemetry(ServiceTelemetry):
    def __init__(self, queue: AdmissionQueue) -> None:
        super().__init__("admission")
        self.queue = queue
        self.spans: dict[str, Span] = {}
        self.admitted = 0
        self.rejected_queue_full = 0
        self.rejected_unservable = 0

    def on_submit(self, request: TokenizedRequest) -> None:
        if self.tracing:
            self.spans[request.request_id] = self.tracer.start_span(
                "orca.admission.queue", context=context_from_traceparent(request.trace_context),
                attributes={"orca.request_id": request.request_id, "orca.queue_len": len(self.queue.queue)})

    def on_rejected(self, exc: Exception) -> None:
        if isinstance(exc, QueueFull):
            self.rejected_queue_full += 1
        else:
            self.rejected_unservable += 1

    def on_admitted(self, replica: str, requests: list[TokenizedRequest]) -> None:
        self.admitted += len(requests)
        for request in requests:
            span = self.spans.pop(request.request_id, None)
            if span is not None:
                span.set_attribute("orca.replica", replica)
                span.end()

    def on_ended(self, request: TokenizedRequest, reason: FinishReason, error: str | None) -> None:
        span = self.spans.pop(request.request_id, None)
        if span is not None:
            span.set_attribute("orca.finish_reason", reason.label)
            if reason is FinishReason.ERROR:
                span.set_status(Status(StatusCode.ERROR, error or "error"))
            span.end()

    def snapshot(self) -> AdmissionMetrics:
        return AdmissionMetrics(self.source, len(self.queue.queue), self.queue.max_queue_len, self.admitted,
                                self.rejected_queue_full, self.rejected_unservable)
