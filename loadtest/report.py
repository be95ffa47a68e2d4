"""What a benchmark run measured, and the numbers made from it. Pure: no clock, no I/O.

A `RequestRecord` holds the times one request was sent, got each chunk of output tokens
and finished (seconds on any one clock: the wall clock for `orca bench`, the simulated
clock for `orca simulate`). `summarize` turns a run's records into the metrics `vllm bench
serve` prints, plus the Orca paper's normalized latency (end-to-end latency divided by the
request's output tokens). `capacity_at` reads a sweep the way the paper does: the highest
throughput whose median normalized latency stays under a target.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    request_id: str
    start_s: float
    """When the request was sent (or entered the engine)."""
    prompt_len: int = 0
    chunk_times: list[float] = field(default_factory=list)
    """When each chunk of output tokens arrived (one per iteration for orca-serve)."""
    output_tokens: int = 0
    finished_s: float | None = None
    error: str | None = None

    def add_chunk(self, now: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times.append(now)
            self.output_tokens += num_tokens

    def finish(self, now: float, error: str | None = None) -> None:
        self.finished_s, self.error = now, error

    @property
    def success(self) -> bool:
        return self.finished_s is not None and self.error is None and self.output_tokens > 0

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.start_s

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for one-token requests."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def normalized_latency_s(self) -> float:
        return self.e2e_s / self.output_tokens

    def to_json(self, t0: float = 0.0) -> dict:
        return {"id": self.request_id, "start_s": self.start_s - t0, "prompt_len": self.prompt_len,
                "output_tokens": self.output_tokens,
                "finished_s": None if self.finished_s is None else self.finished_s - t0, "error": self.error,
                "chunk_times_s": [t - t0 for t in self.chunk_times]}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    ms = [v * 1000.0 for v in values_s]
    return {f"mean_{name}_ms": sum(ms) / len(ms), f"median_{name}_ms": percentile(ms, 50),
            f"p99_{name}_ms": percentile(ms, 99)}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    targets: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput target {item!r}: metric must be one of {GOODPUT_METRICS}")
        try:
            targets[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput target {item!r} must be METRIC:MILLISECONDS") from None
        if not targets[name] > 0:
            raise ValueError(f"goodput target {item!r} must be > 0 ms")
    return targets


def _meets(record: RequestRecord, targets_ms: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    return all(measured[name] * 1000.0 <= limit for name, limit in targets_ms.items())


def summarize(records: list[RequestRecord], duration_s: float,
              goodput_ms: dict[str, float] | None = None) -> dict[str, float]:
    """vLLM `bench serve`'s metrics (plus normalized latency) for one run."""
    done = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    duration_s = max(duration_s, 1e-9)
    metrics: dict[str, float] = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    if goodput_ms:
        metrics["request_goodput"] = sum(_meets(r, goodput_ms) for r in done) / duration_s
    metrics |= _stats("ttft", [r.ttft_s for r in done])
    metrics |= _stats("tpot", [t for r in done if (t := r.tpot_s) is not None])
    metrics |= _stats("itl", [itl for r in done for itl in r.itls_s])
    metrics |= _stats("e2el", [r.e2e_s for r in done])
    metrics |= _stats("norm_latency", [r.normalized_latency_s for r in done])
    return metrics


def format_report(metrics: dict[str, float], title: str, goodput_ms: dict[str, float] | None = None) -> str:
    rows = [("Successful requests", f"{metrics['completed']:.0f}"), ("Failed requests", f"{metrics['failed']:.0f}"),
            ("Benchmark duration (s)", f"{metrics['duration_s']:.2f}"),
            ("Total input tokens", f"{metrics['total_input_tokens']:.0f}"),
            ("Total generated tokens", f"{metrics['total_output_tokens']:.0f}"),
            ("Request throughput (req/s)", f"{metrics['request_throughput']:.3f}"),
            ("Output token throughput (tok/s)", f"{metrics['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.1f}")]
    if "request_goodput" in metrics:
        targets = " ".join(f"{k}<={v:g}ms" for k, v in (goodput_ms or {}).items())
        rows.append((f"Request goodput (req/s) [{targets}]", f"{metrics['request_goodput']:.3f}"))
    lines = [f"{' ' + title + ' ':=^60}"] + [f"{k:<44}{v:>16}" for k, v in rows]
    for key, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
                       ("norm_latency", "Normalized Latency (e2e / output token)")):
        lines.append(f"{' ' + label + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{stat.capitalize() + ' ' + key.upper() + ' (ms)':<44}{metrics[f'{stat}_{key}_ms']:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


@dataclass(frozen=True)
class Capacity:
    req_s: float
    kind: str
    """`interpolated` (crossed the target between two rates), `lower-bound` (never above the
    target in the sweep: the true capacity is at least this), or `below-range` (above the
    target already at the lowest rate: capacity under that rate's throughput, reported as 0)."""

    def describe(self) -> str:
        return {"interpolated": f"{self.req_s:.3f} req/s", "lower-bound": f">= {self.req_s:.3f} req/s",
                "below-range": "below the lowest rate measured"}[self.kind]


def capacity_at(points: list[tuple[float, float]], target_ms: float) -> Capacity:
    """`points` are (throughput req/s, median normalized latency ms/token) in order of increasing
    offered rate. Returns the throughput where the curve first rises through the target,
    linearly interpolated between the last point under it and the first point over it."""
    previous: tuple[float, float] | None = None
    for throughput, latency in points:
        if latency > target_ms:
            if previous is None:
                return Capacity(0.0, "below-range")
            t0, l0 = previous
            return Capacity(t0 + (throughput - t0) * (target_ms - l0) / (latency - l0), "interpolated")
        previous = (throughput, latency)
    if previous is None:
        return Capacity(0.0, "below-range")
    return Capacity(previous[0], "lower-bound")


def capacity_ratio(a: Capacity, b: Capacity) -> tuple[float, str]:
    """a / b and how to read it: exact, a lower bound ('>='), an upper bound ('<=') or unknown."""
    if b.req_s <= 0:
        return math.inf, ">=" if a.req_s > 0 else "?"
    ratio = a.req_s / b.req_s
    if a.kind == "below-range":
        return ratio, "<="
    if a.kind == "lower-bound" and b.kind != "lower-bound":
        return ratio, ">="
    if b.kind == "lower-bound" and a.kind != "lower-bound":
        return ratio, "<="
    if a.kind == b.kind == "lower-bound":
        return ratio, "?"
    return ratio, "="


def orca_counterpart(label: str, policy: str, labels: Iterable[str]) -> str | None:
    """The orca curve to compare a curve with: 'orca (X)' for 'request-level (X)' when there is
    one, else plain 'orca'; None for orca curves and when there is no orca curve."""
    if policy == "orca":
        return None
    labels = set(labels)
    twin = "orca" + label[len(policy):] if label.startswith(policy) else None
    if twin in labels:
        return twin
    return "orca" if "orca" in labels else None
