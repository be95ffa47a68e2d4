"""GET /metrics in Prometheus' text format: this gateway's own `orca:` counters, and the system's
metrics under vLLM's names (`vllm:...`, so existing vLLM dashboards work) plus Orca's own.

How the system's metrics are aggregated: every tokenizer, admission and engine process publishes
a typed snapshot of its cumulative counters and histograms on `orca.v1.metrics` once a second
(`shared.telemetry.SnapshotPublisher`). `MetricsBoard` keeps the latest snapshot of every source
(a source is one process start):
- counters and histograms are the sum over all sources ever heard, dead ones included, so a
  restarted process adds to a counter instead of resetting it, and N tokenizers or engines add up;
- gauges come only from sources heard in the last STALE_S seconds, and for an engine only from its
  newest source (a restarted replica replaces its old self).
Engine metrics carry an `engine` label (the replica), as vLLM's do; every vllm: metric carries
`model_name`. Each gateway hears every snapshot, so several gateways serve the same figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shared.messages import AdmissionMetrics, EngineMetrics, HistogramData, MetricsSnapshot, TokenizerMetrics
from shared.outputs import FinishReason
from shared.telemetry import (BATCH_SIZE_BUCKETS, ITERATION_TOKEN_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS,
                              TOKEN_COUNT_BUCKETS, TTFT_BUCKETS, TelemetryConfig)

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

log = logging.getLogger("orca.gateway")
snapshot_decoder = msgspec.msgpack.Decoder(MetricsSnapshot)

STALE_S = 5.0
"""A gauge older than this is not shown (snapshots come every second, by default), nor one older than
three snapshot intervals (ORCA_METRICS_INTERVAL_S), whichever is longer."""


class MetricsBoard:
    """The latest snapshot of every source, with when it came."""

    def __init__(self, stale_s: float | None = None) -> None:
        self.sources: dict[str, tuple[MetricsSnapshot, float]] = {}
        self.stale_s = stale_s if stale_s is not None else max(STALE_S,
                                                               3 * TelemetryConfig.from_env().metrics_interval_s)

    async def on_message(self, msg) -> None:
        try:
            self.on_snapshot(snapshot_decoder.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad metrics snapshot: %s", exc)

    def on_snapshot(self, snapshot: MetricsSnapshot, now: float | None = None) -> None:
        self.sources[snapshot.source] = (snapshot, time.monotonic() if now is None else now)

    def all_of(self, kind: type) -> list:
        return [s for s, _ in self.sources.values() if isinstance(s, kind)]

    def fresh_of(self, kind: type, now: float | None = None) -> list:
        now = time.monotonic() if now is None else now
        return [s for s, at in self.sources.values() if isinstance(s, kind) and now - at < self.stale_s]

    def live_engines(self, now: float | None = None) -> list[EngineMetrics]:
        """The newest fresh snapshot of each replica."""
        now = time.monotonic() if now is None else now
        newest: dict[str, tuple[EngineMetrics, float]] = {}
        for snapshot, at in self.sources.values():
            if isinstance(snapshot, EngineMetrics) and now - at < self.stale_s:
                if snapshot.replica not in newest or at > newest[snapshot.replica][1]:
                    newest[snapshot.replica] = (snapshot, at)
        return [s for s, _ in sorted(newest.values(), key=lambda item: item[0].replica)]


class SystemCollector(Collector):
    """The vllm: and orca: families built from a board, for one scrape."""

    def __init__(self, board: MetricsBoard, model_name: str, now: float | None = None) -> None:
        self.board, self.model = board, model_name
        self.now = time.monotonic() if now is None else now

    def collect(self) -> Iterable:
        sources = GaugeMetricFamily("orca:metrics_sources", "Processes whose metric snapshot is fresh, by kind.",
                                    labels=["kind"])
        for kind in (TokenizerMetrics, AdmissionMetrics, EngineMetrics):
            sources.add_metric([kind.__struct_config__.tag], len(self.board.fresh_of(kind, self.now)))
        yield sources
        yield from self._engine_gauges()
        yield from self._request_families()
        yield from self._engine_counters()
        yield from self._admission()

    def _engine_gauges(self) -> Iterable:
        engines = self.board.live_engines(self.now)
        admission = self.board.fresh_of(AdmissionMetrics, self.now)
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in an engine's running batch.",
                                    labels=labels)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting: in an engine's queue, or (engine=\"admission\") "
            "in the global admission queue in front of all engines.", labels=labels)
        families = {name: GaugeMetricFamily(name, text, labels=labels) for name, text in (
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent (blocks held / blocks)."),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 means 100 percent (older name of kv_cache_usage_perc)."),
            ("orca:kv_reserved_slots", "KV slots in blocks held by running requests (Orca reserves prompt + "
                                       "max_tokens at admission)."),
            ("orca:kv_used_slots", "KV slots holding computed tokens; reserved minus used is reservation waste."),
            ("orca:kv_total_slots", "KV capacity in slots."),
            ("orca:max_num_seqs", "Most requests an engine runs at once (batch size bound)."),
        )}
        for e in engines:
            key = [self.model, e.replica]
            usage = e.kv_used_blocks / e.num_blocks if e.num_blocks else 0.0
            running.add_metric(key, e.num_running)
            waiting.add_metric(key, e.num_waiting)
            for name, value in (("vllm:kv_cache_usage_perc", usage), ("vllm:gpu_cache_usage_perc", usage),
                                ("orca:kv_reserved_slots", e.kv_reserved_slots),
                                ("orca:kv_used_slots", e.kv_used_slots),
                                ("orca:kv_total_slots", e.num_blocks * e.block_size),
                                ("orca:max_num_seqs", e.max_num_seqs)):
                families[name].add_metric(key, value)
        if admission:
            waiting.add_metric([self.model, "admission"], sum(a.queue_len for a in admission))
        yield running
        yield waiting
        yield from families.values()

    def _request_families(self) -> Iterable:
        tokenizers: list[TokenizerMetrics] = self.board.all_of(TokenizerMetrics)
        labels, key = ["model_name"], [self.model]
        prompt = CounterMetricFamily("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels=labels)
        prompt.add_metric(key, sum(t.prompt_tokens for t in tokenizers))
        generation = CounterMetricFamily("vllm:generation_tokens", "Generated tokens of finished requests.",
                                         labels=labels)
        generation.add_metric(key, sum(t.generation_tokens for t in tokenizers))
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in FinishReason:
            success.add_metric([self.model, reason.label], sum(t.finished.get(reason, 0) for t in tokenizers))
        yield from (prompt, generation, success)
        for name, text, bounds, field in (
            ("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS, "time_to_first_token"),
            ("vllm:inter_token_latency_seconds", "Time between a request's tokens.", ITL_BUCKETS,
             "inter_token_latency"),
            ("vllm:e2e_request_latency_seconds", "Arrival to final event.", LATENCY_BUCKETS, "e2e_request_latency"),
        ):
            yield _histogram(name, text, bounds, labels, {(self.model,): [getattr(t, field) for t in tokenizers]})
        sizes = [t.request_sizes for t in tokenizers if t.request_sizes is not None]
        for name, text, field in (
            ("vllm:request_prompt_tokens", "Prompt tokens per request served.", "prompt_tokens"),
            ("vllm:request_generation_tokens", "Generated tokens per request served.", "generation_tokens"),
            ("vllm:request_params_max_tokens", "The max_tokens of requests served that gave one.", "max_tokens"),
        ):
            yield _histogram(name, text, TOKEN_COUNT_BUCKETS, labels,
                             {(self.model,): [getattr(s, field) for s in sizes]})
        active = GaugeMetricFamily("orca:num_requests_active", "Requests accepted by tokenizers and not yet ended.",
                                   labels=labels)
        active.add_metric(key, sum(t.num_active for t in self.board.fresh_of(TokenizerMetrics, self.now)))
        yield active

    def _engine_counters(self) -> Iterable:
        engines: list[EngineMetrics] = self.board.all_of(EngineMetrics)
        labels = ["model_name", "engine"]
        by_replica: dict[tuple[str, ...], list[EngineMetrics]] = {}
        for e in engines:
            by_replica.setdefault((self.model, e.replica), []).append(e)
        counters = [
            (CounterMetricFamily("vllm:num_preemptions", "Requests preempted (sent back to wait).", labels=labels),
             "num_preemptions"),
            (CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache, "
                                 "once per admission to run.", labels=labels), "prefix_cache_queries"),
            (CounterMetricFamily("vllm:prefix_cache_hits", "Of those, tokens found in the prefix cache.",
                                 labels=labels), "prefix_cache_hits"),
            (CounterMetricFamily("orca:iterations", "Iterations run.", labels=labels), "iterations"),
        ]
        for family, field in counters:
            for key, snapshots in sorted(by_replica.items()):
                family.add_metric(list(key), sum(getattr(e, field) for e in snapshots))
            yield family
        for name, text, bounds, field in (
            ("vllm:request_queue_time_seconds", "Arrival (tokenizer) to first scheduled in an engine: "
                                                "admission queue plus engine queue.", LATENCY_BUCKETS,
             "request_queue_time"),
            ("vllm:iteration_tokens_total", "Tokens per iteration (prefill and decode).", ITERATION_TOKEN_BUCKETS,
             "iteration_tokens"),
            ("orca:batch_size", "Requests per iteration.", BATCH_SIZE_BUCKETS, "batch_size"),
        ):
            groups = {key: [getattr(e, field) for e in snapshots] for key, snapshots in by_replica.items()}
            yield _histogram(name, text, bounds, labels, groups)
        for name, text, bounds, field in (
            ("vllm:request_prefill_time_seconds", "First scheduled to first token, per request that ended in "
                                                  "the engine after its first token.", LATENCY_BUCKETS, "prefill"),
            ("vllm:request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS, "decode"),
            ("vllm:request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS, "inference"),
            ("vllm:request_time_per_output_token_seconds", "A request's decode time over its tokens after the "
                                                           "first.", ITL_BUCKETS, "time_per_output_token"),
        ):
            groups = {key: [getattr(e.request_phases, field) for e in snapshots if e.request_phases is not None]
                      for key, snapshots in by_replica.items()}
            yield _histogram(name, text, bounds, labels, groups)

    def _admission(self) -> Iterable:
        admissions: list[AdmissionMetrics] = self.board.all_of(AdmissionMetrics)
        rejections = CounterMetricFamily("orca:admission_rejections", "Requests admission refused, by reason (a "
                                         "gateway's refusals at the door, before publishing, are its "
                                         "orca:http_requests_total with code 429 or 503).", labels=["reason"])
        rejections.add_metric(["queue_full"], sum(a.rejected_queue_full for a in admissions))
        rejections.add_metric(["unservable"], sum(a.rejected_unservable for a in admissions))
        admitted = CounterMetricFamily("orca:admitted_requests", "Requests admission sent to an engine.")
        admitted.add_metric([], sum(a.admitted for a in admissions))
        yield rejections
        yield admitted


def _histogram(name: str, text: str, bounds: Sequence[float], labels: list[str],
               groups: dict[tuple[str, ...], list[HistogramData]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text, labels=labels)
    for key, parts in sorted(groups.items()):
        counts = [0] * (len(bounds) + 1)
        total = 0.0
        for part in parts:
            if len(part.counts) != len(counts):
                continue  # another version's buckets: cannot be added up
            counts = [a + b for a, b in zip(counts, part.counts)]
            total += part.sum
        cumulative, buckets = 0, []
        for bound, count in zip([*map(_le, bounds), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(list(key), buckets, total)
    return family


def _le(bound: float) -> str:
    return repr(float(bound))


def render_system_metrics(board: MetricsBoard, model_name: str, now: float | None = None) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SystemCollector(board, model_name, now))
    return generate_latest(registry).decode()


def render_metrics(state: GatewayState) -> str:
    return render_gateway_metrics(state) + render_system_metrics(state.client.metrics, state.settings.model_name)


def render_gateway_metrics(state: GatewayState) -> str:
    status = state.client.status
    admission = status.fresh_admission()
    lines = [
        "# HELP orca:http_requests_total HTTP responses of this gateway by route and status code.",
        "# TYPE orca:http_requests_total counter",
    ]
    for (route, code), count in sorted(state.http_requests.items()):
        lines.append(f'orca:http_requests_total{{route="{_escape(route)}",code="{code}"}} {count}')
    gauges = [
        ("orca:num_requests_running", "Generation requests this gateway is waiting on.", state.client.num_running),
        ("orca:admission_queue_len", "Requests waiting in the admission queue (-1: no recent status).",
         admission.queue_len if admission else -1),
        ("orca:admission_max_queue_len", "The admission queue's bound (-1: no recent status).",
         admission.max_queue_len if admission else -1),
        ("orca:num_engines_ready", "Engine replicas the admission scheduler counts as ready.",
         status.num_engines_ready),
    ]
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    for kind in ("prompt", "completion"):
        name = f"orca:{kind}_tokens_total"
        lines += [f"# HELP {name} {kind.capitalize()} tokens of the requests this gateway served.",
                  f"# TYPE {name} counter", f"{name} {state.tokens[kind]}"]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
