"""Telemetry set-up shared by every process: OpenTelemetry tracing, W3C trace context on NATS,
and the histograms behind the Prometheus metrics.

Tracing is configured once per process from standard OTel environment variables
(`TelemetryConfig.from_env`) by `setup_tracing(component)`; with the default exporter `none` it
installs nothing and every span is OTel's no-op span, so a disabled process pays almost nothing.

Metrics are not scraped from each process: every service keeps cumulative counters and
histograms and publishes a typed snapshot (`shared.messages.MetricsSnapshot`) on
`subjects.METRICS` once a second (`SnapshotPublisher`); the gateway sums them per source
(`services.gateway.metrics`). A source is one process start, so a restart adds a new source
instead of resetting a counter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import uuid
from bisect import bisect_left
from collections.abc import Callable, Sequence

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.messages import HistogramData, RequestPhases, RequestSizes

log = logging.getLogger("orca.telemetry")

EXPORTERS = ("none", "console", "otlp", "jsonl")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
"""OTEL_EXPORTER_OTLP_PROTOCOL's values that the Python SDK exports (it has no http/json exporter)."""
SAMPLERS = {"always_on": 1.0, "parentbased_always_on": 1.0, "always_off": 0.0, "parentbased_always_off": 0.0,
            "traceidratio": None, "parentbased_traceidratio": None}
"""OTEL_TRACES_SAMPLER's values -> their ratio (None: OTEL_TRACES_SAMPLER_ARG). Every sampler here is
parent-based: a request's spans in every service follow the decision of its first one."""

# vLLM's bucket bounds, so dashboards' histogram_quantile reads the same resolution.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))
"""1, 2, 5, 10, ... 5,000,000: vLLM's 1-2-5 series (vLLM stops it at the model's length; one fixed list
here, so every process's counts add up)."""


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    exporter: str = "none"
    """Where spans go: `none`, `console` (stdout), `otlp` (gRPC to `otlp_endpoint`), `jsonl` (one
    JSON object per span appended to `jsonl_path`; tests collect spans of many processes with it)."""
    jsonl_path: str | None = None
    otlp_endpoint: str | None = None
    """An OTLP collector: http://otel-collector:4317 over gRPC, or the whole traces URL over HTTP
    (http://otel-collector:4318/v1/traces)."""
    otlp_protocol: str = "grpc"
    """`grpc` or `http/protobuf` (OTEL_EXPORTER_OTLP_PROTOCOL)."""
    service_name: str | None = None
    """OTel service.name; None means `orca-<component>`."""
    sampler_ratio: float = 1.0
    """Fraction of new traces sampled (parent-based: a request's spans follow its first decision)."""
    metrics_interval_s: float = 1.0
    """How often each service publishes its metric snapshot."""

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"traces exporter {self.exporter!r} is not one of {EXPORTERS}")
        if self.exporter == "jsonl" and not self.jsonl_path:
            raise ValueError("the jsonl traces exporter needs a path: ORCA_TRACES_EXPORTER=jsonl:<path>")
        if self.exporter == "otlp" and not self.otlp_endpoint:
            raise ValueError("the otlp traces exporter needs OTEL_EXPORTER_OTLP_ENDPOINT")
        if self.otlp_protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"OTLP protocol {self.otlp_protocol!r} (OTEL_EXPORTER_OTLP_PROTOCOL) is not one of "
                             f"{OTLP_PROTOCOLS}")
        if not 0.0 <= self.sampler_ratio <= 1.0:
            raise ValueError(f"sampler ratio {self.sampler_ratio} (OTEL_TRACES_SAMPLER_ARG) must be in [0, 1]")
        if self.metrics_interval_s <= 0:
            raise ValueError(f"metrics_interval_s={self.metrics_interval_s} must be > 0")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TelemetryConfig:
        """The standard OTel variables: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT and _PROTOCOL, OTEL_TRACES_EXPORTER,
        OTEL_TRACES_SAMPLER and _ARG, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED; and ORCA_TRACES_EXPORTER=none|console|
        otlp|jsonl:<path>, which wins over OTEL_TRACES_EXPORTER (default: otlp when an endpoint is set, else none),
        ORCA_METRICS_INTERVAL_S. A standard value this SDK set-up cannot honour (an exporter or a sampler it does
        not have, http/json) is a warning naming the variable and its fallback, never a failure to start:
        tooling such as the OTel Operator sets these for every container."""
        env = os.environ if environ is None else environ
        protocol_var = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                             if env.get(v)), None)
        protocol = env[protocol_var].strip().lower() if protocol_var else "grpc"
        if protocol not in OTLP_PROTOCOLS:
            fallback = "http/protobuf" if protocol.startswith("http") else "grpc"
            log.warning("%s=%s is not one this SDK exports (%s); using %s", protocol_var, protocol,
                        ", ".join(OTLP_PROTOCOLS), fallback)
            protocol = fallback
        endpoint = _otlp_endpoint(env, protocol)
        exporter = (env.get("ORCA_TRACES_EXPORTER") or _standard_exporter(env.get("OTEL_TRACES_EXPORTER"))
                    or ("otlp" if endpoint else "none")).strip()
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            exporter = "none"
        if exporter == "otlp" and endpoint is None:  # the specification's default collector, on this host
            endpoint = DEFAULT_OTLP_ENDPOINTS[protocol]
        path = None
        if exporter.startswith("jsonl:"):
            exporter, path = "jsonl", exporter[len("jsonl:"):]
        sampler = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_traceidratio").strip().lower()
        if sampler not in SAMPLERS:
            log.warning("OTEL_TRACES_SAMPLER=%s is not one of %s; using parentbased_traceidratio", sampler,
                        ", ".join(SAMPLERS))
            sampler = "parentbased_traceidratio"
        try:
            ratio = SAMPLERS[sampler]
            if ratio is None:
                ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG") or 1.0)
            interval = float(env.get("ORCA_METRICS_INTERVAL_S") or 1.0)
        except ValueError as exc:
            raise ValueError(f"bad telemetry setting (OTEL_TRACES_SAMPLER_ARG or ORCA_METRICS_INTERVAL_S): {exc}") \
                from None
        return cls(exporter=exporter, jsonl_path=path, otlp_endpoint=endpoint, otlp_protocol=protocol,
                   service_name=env.get("OTEL_SERVICE_NAME") or None, sampler_ratio=ratio,
                   metrics_interval_s=interval)


DEFAULT_OTLP_ENDPOINTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318/v1/traces"}
"""The OTel specification's default collector for each protocol."""


def _standard_exporter(value: str | None) -> str | None:
    """OTEL_TRACES_EXPORTER (a comma-separated list in the specification) as the one exporter set up here:
    none wins, then otlp, then console; what is not one of those is a warning."""
    if not value:
        return None
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("none", "otlp", "console")]
    if unknown:
        log.warning("OTEL_TRACES_EXPORTER: %s not available here (otlp, console or none); ignored", ", ".join(unknown))
    return next((name for name in ("none", "otlp", "console") if name in names), "none")


def _otlp_endpoint(env, protocol: str) -> str | None:
    """The collector to export to. Over HTTP the signal's own variable is the whole URL and the general one
    gets `/v1/traces` appended (the OTel specification's rule); over gRPC either is host and port."""
    traces, general = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if traces:
        return traces
    if general and protocol == "http/protobuf":
        return general.rstrip("/") + "/v1/traces"
    return general or None


# ---- tracing set-up ------------------------------------------------------------------------------

_setup_lock = threading.Lock()
_enabled: bool | None = None


def setup_tracing(component: str, config: TelemetryConfig | None = None) -> bool:
    """Install this process's tracer provider (once; later calls return the first answer).
    Returns whether spans are recorded."""
    global _enabled
    with _setup_lock:
        if _enabled is not None:
            return _enabled
        config = config or TelemetryConfig.from_env()
        _enabled = config.exporter != "none"
        if _enabled:
            trace.set_tracer_provider(_provider(component, config))
        return _enabled


def tracing_enabled() -> bool:
    return bool(_enabled)


def _provider(component: str, config: TelemetryConfig):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": config.service_name or f"orca-{component}",
                                "service.namespace": "orca-serve", "orca.component": component,
                                "service.instance.id": uuid.uuid4().hex[:12]})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sampler_ratio)))
    if config.exporter == "console":
        exporter = ConsoleSpanExporter()
    elif config.exporter == "jsonl":
        exporter = JsonLinesSpanExporter(config.jsonl_path)
    elif config.otlp_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as OTLPHttpSpanExporter

        exporter = OTLPHttpSpanExporter(endpoint=config.otlp_endpoint)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
    # Batched: the hot loop only appends to a queue; export happens on the processor's thread.
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


class JsonLinesSpanExporter:
    """Appends one JSON object per span to a file; several processes may share the file (each
    batch is one O_APPEND write). Spans carry their process's service.name."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span) -> dict:
    """A finished SDK span as plain JSON data (ids in hex, times in ns)."""
    ctx = span.get_span_context()
    return {
        "name": span.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "kind": span.kind.name, "start_ns": span.start_time, "end_ns": span.end_time,
        "status": span.status.status_code.name, "service": span.resource.attributes.get("service.name"),
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
                   "attributes": dict(link.attributes or {})} for link in span.links],
    }


# ---- W3C trace context across HTTP and NATS ----------------------------------------------------

_propagator = TraceContextTextMapPropagator()


def trace_headers(context: Context | None = None) -> dict[str, str] | None:
    """`traceparent` (and `tracestate`) of the current span, or of `context`; None when there is
    no recording span (NATS then sends no headers)."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier or None


def context_from_headers(headers: dict[str, str] | None) -> Context | None:
    if not headers or "traceparent" not in headers:
        return None
    return _propagator.extract(headers)


def traceparent(span: trace.Span) -> str | None:
    """The span's W3C traceparent, to carry inside a message (batched messages cannot use headers)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from_traceparent(value: str | None) -> Context | None:
    return _propagator.extract({"traceparent": value}) if value else None


def span_context_of(context: Context | None) -> trace.SpanContext | None:
    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


# ---- metrics -----------------------------------------------------------------------------------

class Histogram:
    """Cumulative since process start: per-bucket counts (last bucket is +Inf) and the sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le semantics: value == bound goes in that bucket
        self.sum += value

    def data(self) -> HistogramData:
        return HistogramData(list(self.counts), self.sum)


class SizeHistograms:
    """RequestSizes, as a process collects them."""

    def __init__(self) -> None:
        self.prompt_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.generation_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.max_tokens = Histogram(TOKEN_COUNT_BUCKETS)

    def observe(self, num_prompt_tokens: int, num_generated: int, max_tokens: int | None) -> None:
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_generated)
        if max_tokens is not None:  # null (until the context is full) gives no number
            self.max_tokens.observe(max_tokens)

    def data(self) -> RequestSizes:
        return RequestSizes(self.prompt_tokens.data(), self.generation_tokens.data(), self.max_tokens.data())


class PhaseHistograms:
    """RequestPhases, as an engine collects them."""

    def __init__(self) -> None:
        self.prefill = Histogram(LATENCY_BUCKETS)
        self.decode = Histogram(LATENCY_BUCKETS)
        self.inference = Histogram(LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(ITL_BUCKETS)

    def observe(self, prefill_s: float, decode_s: float, num_generated: int) -> None:
        self.prefill.observe(prefill_s)
        self.decode.observe(decode_s)
        self.inference.observe(prefill_s + decode_s)
        if num_generated > 1:
            self.time_per_output_token.observe(decode_s / (num_generated - 1))

    def data(self) -> RequestPhases:
        return RequestPhases(self.prefill.data(), self.decode.data(), self.inference.data(),
                             self.time_per_output_token.data())


def new_source_id(kind: str) -> str:
    """One id per process start: a restarted process is a new source, so counters never go back."""
    return f"{kind}-{uuid.uuid4().hex[:12]}"


class SnapshotPublisher:
    """Publishes `snapshot()` on subjects.METRICS every `interval_s` until stopped or the
    connection closes. One small message a second per process; it carries cumulative values, so
    a lost message costs nothing but freshness."""

    def __init__(self, nc, snapshot: Callable[[], msgspec.Struct], interval_s: float | None = None) -> None:
        """`interval_s`: None for ORCA_METRICS_INTERVAL_S (every service follows the one setting)."""
        self.nc, self.snapshot = nc, snapshot
        self.interval_s = TelemetryConfig.from_env().metrics_interval_s if interval_s is None else interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def publish_now(self) -> None:
        from shared import subjects
        from shared.codec import Codec

        await self.nc.publish(subjects.METRICS, Codec.encode(self.snapshot()))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.nc.is_closed:
                return
            try:
                await self.publish_now()
            except Exception as exc:  # noqa: BLE001 - draining or reconnecting: the next tick tries again
                log.debug("metrics snapshot not published: %s", exc)


class ServiceTelemetry:
    """What a service's telemetry starts from: tracing set up for it, its tracer, and the source id its
    metric snapshots carry."""

    def __init__(self, service: str) -> None:
        self.tracing = setup_tracing(service)
        self.tracer = get_tracer(f"orca.{service}")
        self.source = new_source_id(service)
