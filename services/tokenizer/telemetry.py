"""The tokenizer's telemetry: the request span (arrival to final event, OTel GenAI conventions) and
the per-request metrics (TTFT, inter-token latency, end-to-end latency, tokens, finish reasons).
The tokenizer is where every request arrives and where its final event leaves, so both are
measured here, once per request, whichever producer sent it.

Span tree of one request (its parent is the producer's traceparent from the NATS headers, e.g. the
gateway's HTTP span): `{operation} {model}` > `tokenize`, `detokenize`; admission adds
`orca.admission.queue` and the engine `orca.engine.request` under the same span.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shared.api import GenerateRequest
from shared.messages import TokenizerMetrics
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from shared.telemetry import (ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, Histogram, ServiceTelemetry,
                              SizeHistograms, context_from_headers, traceparent)


@dataclass
class RequestTrace:
    span: Span | None
    arrival: float
    """perf_counter() when the request arrived."""
    max_tokens: int | None = None
    """What the request asked for."""
    first_output: float | None = None
    last_output: float | None = None
    detokenize_s: float = 0.0


class TokenizerTelemetry(ServiceTelemetry):
    def __init__(self, model_name: str) -> None:
        super().__init__("tokenizer")
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[FinishReason] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.sizes = SizeHistograms()
        self.num_active = 0

    def on_accept(self, request: GenerateRequest, params: SamplingParams, num_prompt_tokens: int,
                  headers: dict[str, str] | None, arrival_ns: int, tokenize_ns: tuple[int, int]) -> RequestTrace:
        """A valid request was tokenized: open its span (from `arrival_ns`) with a `tokenize` child."""
        self.num_active += 1
        trace = RequestTrace(None, time.perf_counter() - (time.time_ns() - arrival_ns) / 1e9, params.max_tokens)
        if not self.tracing:
            return trace
        operation = request.operation or ("chat" if request.messages is not None else "text_completion")
        attributes = {
            "gen_ai.operation.name": operation, "gen_ai.system": "orca-serve",
            "gen_ai.provider.name": "orca-serve", "gen_ai.request.model": self.model_name,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k,
            "gen_ai.request.presence_penalty": params.presence_penalty,
            "gen_ai.request.frequency_penalty": params.frequency_penalty,
            "gen_ai.request.stop_sequences": list(params.stop), "gen_ai.response.id": request.id,
            "gen_ai.usage.input_tokens": num_prompt_tokens, "orca.request_id": request.id,
            "orca.priority": request.priority}
        if params.max_tokens is not None:  # null: until the context is full, no number to report
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        trace.span = self.tracer.start_span(f"{operation} {self.model_name}", context=context_from_headers(headers),
                                            kind=SpanKind.SERVER, start_time=arrival_ns, attributes=attributes)
        self._child(trace.span, "tokenize", *tokenize_ns, {"gen_ai.usage.input_tokens": num_prompt_tokens})
        return trace

    def traceparent(self, trace: RequestTrace) -> str | None:
        return traceparent(trace.span) if trace.span is not None else None

    def on_reject(self, request_id: str | None, headers: dict[str, str] | None, error: str) -> None:
        """An invalid request: a short error span, so the caller's trace shows why. None for one that
        names no request and is in no trace (`orca serve`'s readiness probe sends `{}`): no one could
        find that span, and it would open every deployment's traces with an error."""
        if self.tracing and (request_id or "traceparent" in (headers or {})):
            span = self.tracer.start_span("orca.request.invalid", context=context_from_headers(headers),
                                          attributes={"orca.request_id": request_id or "", "error.type": "invalid"})
            span.set_status(Status(StatusCode.ERROR, error))
            span.end()

    def on_output(self, trace: RequestTrace, num_new_tokens: int, detokenize_s: float) -> None:
        now = time.perf_counter()
        trace.detokenize_s += detokenize_s
        if num_new_tokens:
            if trace.first_output is None:
                trace.first_output = now
                self.ttft.observe(now - trace.arrival)
                if trace.span is not None:
                    trace.span.add_event("gen_ai.first_token")
            else:
                # one event per iteration, so the gap is the latency of each of its tokens
                self.itl.observe((now - trace.last_output) / num_new_tokens)
            trace.last_output = now

    def on_final(self, trace: RequestTrace, reason: FinishReason, num_prompt_tokens: int, num_generated: int,
                 error: str | None, retry: bool = False) -> None:
        """A request's last event. Its prompt tokens count once an engine has read them (its first token
        came: vLLM counts them then). One refused for a cause that passes (a full queue, no engine, a
        stack shutting down), before any token, is a rejection (admission counts those), not a finished
        request: it adds no `finished` count and no latency sample, which would fall in an overload."""
        now = time.perf_counter()
        self.num_active -= 1
        if num_generated:
            self.prompt_tokens += num_prompt_tokens
            # per request, as the counters count: their sums are the prompt and generation counters' shares
            self.sizes.observe(num_prompt_tokens, num_generated, trace.max_tokens)
        self.generation_tokens += num_generated
        if not (reason is FinishReason.ERROR and retry and not num_generated):
            self.finished[reason] += 1
            self.e2e.observe(now - trace.arrival)
        span = trace.span
        if span is None:
            return
        end_ns = time.time_ns()
        if trace.first_output is not None:
            first_ns = end_ns - int((now - trace.first_output) * 1e9)
            self._child(span, "detokenize", first_ns, end_ns, {"orca.detokenize.busy_s": trace.detokenize_s})
            span.set_attribute("gen_ai.latency.time_to_first_token", trace.first_output - trace.arrival)
        span.set_attributes({"gen_ai.usage.output_tokens": num_generated,
                             "gen_ai.response.finish_reasons": [reason.label],
                             "gen_ai.latency.e2e": now - trace.arrival})
        if reason is FinishReason.ERROR:
            span.set_status(Status(StatusCode.ERROR, error or "error"))
            span.set_attribute("error.type", "engine_error")
        span.end(end_time=end_ns)

    def _child(self, parent: Span, name: str, start_ns: int, end_ns: int, attributes: dict) -> None:
        from opentelemetry import trace

        child = self.tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                                       attributes=attributes)
        child.end(end_time=end_ns)

    def snapshot(self) -> TokenizerMetrics:
        return TokenizerMetrics(
            source=self.source, prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            finished=dict(self.finished), time_to_first_token=self.ttft.data(), inter_token_latency=self.itl.data(),
            e2e_request_latency=self.e2e.data(), num_active=self.num_active, request_sizes=self.sizes.data())
