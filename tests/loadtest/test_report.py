"""The report's metrics on a hand-made trace, and reading capacity off a sweep."""

from __future__ import annotations

import math

import pytest

from loadtest.report import (Capacity, RequestRecord, capacity_at, capacity_ratio, format_report, orca_counterpart,
                          parse_goodput, percentile, summarize)


def trace() -> list[RequestRecord]:
    """r1: 3 tokens at 0.1, 0.2, 0.4 s after a start at 0; r2: 1 token 0.5 s after a start at 1;
    r3: failed. The run lasted 2 s."""
    r1 = RequestRecord("r1", start_s=0.0, prompt_len=10)
    for t in (0.1, 0.2, 0.4):
        r1.add_chunk(t, 1)
    r1.finish(0.4)
    r2 = RequestRecord("r2", start_s=1.0, prompt_len=20)
    r2.add_chunk(1.5, 1)
    r2.finish(1.5)
    r3 = RequestRecord("r3", start_s=1.2, prompt_len=5)
    r3.finish(1.3, "error: boom")
    return [r1, r2, r3]


def test_metrics_of_a_hand_made_trace():
    m = summarize(trace(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 4
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(17.0)
    # TTFT 100 and 500 ms
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["p99_ttft_ms"]) == pytest.approx((300, 300, 496))
    # TPOT only for r1: (400 - 100) / 2 = 150 ms
    assert (m["mean_tpot_ms"], m["median_tpot_ms"], m["p99_tpot_ms"]) == pytest.approx((150, 150, 150))
    # ITL: r1's gaps 100 and 200 ms
    assert (m["mean_itl_ms"], m["median_itl_ms"], m["p99_itl_ms"]) == pytest.approx((150, 150, 199))
    assert (m["mean_e2el_ms"], m["median_e2el_ms"]) == pytest.approx((450, 450))
    # normalized latency: 400 / 3 and 500 / 1 ms per token
    assert m["mean_norm_latency_ms"] == pytest.approx((400 / 3 + 500) / 2)
    assert m["p99_norm_latency_ms"] == pytest.approx(400 / 3 + 0.99 * (500 - 400 / 3))
    assert "request_goodput" not in m


def test_goodput_counts_requests_meeting_every_target():
    assert summarize(trace(), 2.0, {"ttft": 200})["request_goodput"] == pytest.approx(0.5)  # r1 only
    assert summarize(trace(), 2.0, {"tpot": 100})["request_goodput"] == pytest.approx(0.5)  # r2 (1 token) only
    assert summarize(trace(), 2.0, {"ttft": 200, "tpot": 100})["request_goodput"] == 0.0
    assert summarize(trace(), 2.0, {"e2el": 1000})["request_goodput"] == pytest.approx(1.0)
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttfb:5"], ["ttft"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_report_text_names_every_metric():
    text = format_report(summarize(trace(), 2.0, {"ttft": 200}), "orca @ 1 req/s", {"ttft": 200})
    for needle in ("Successful requests", "Failed requests", "Request goodput", "Median TTFT", "P99 ITL",
                   "Mean TPOT", "Median E2EL", "Median NORM_LATENCY"):
        assert needle in text


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([0, 10], 99) == pytest.approx(9.9)


def test_capacity_is_interpolated_where_the_curve_crosses_the_target():
    points = [(1.0, 50.0), (2.0, 100.0), (3.0, 300.0), (2.5, 900.0)]
    assert capacity_at(points, 200.0) == Capacity(2.5, "interpolated")  # halfway from 100 to 300 ms
    assert capacity_at(points, 100.0) == Capacity(2.0, "interpolated")  # exactly on a point
    assert capacity_at(points, 75.0) == Capacity(1.5, "interpolated")
    assert capacity_at(points, 1000.0) == Capacity(2.5, "lower-bound")  # never crossed: the last point
    assert capacity_at(points, 10.0) == Capacity(0.0, "below-range")
    assert capacity_at([], 10.0).kind == "below-range"


def test_capacity_ratio_says_how_to_read_it():
    exact = capacity_ratio(Capacity(6.81, "interpolated"), Capacity(0.185, "interpolated"))
    assert exact[0] == pytest.approx(36.81, abs=0.01) and exact[1] == "="
    assert capacity_ratio(Capacity(8, "lower-bound"), Capacity(2, "interpolated")) == (4.0, ">=")
    assert capacity_ratio(Capacity(8, "interpolated"), Capacity(2, "lower-bound")) == (4.0, "<=")
    assert capacity_ratio(Capacity(8, "interpolated"), Capacity(0, "below-range")) == (math.inf, ">=")


def test_each_curve_is_compared_with_its_orca_counterpart():
    labels = ["orca", "request-level", "orca (simulated)", "request-level (simulated)", "request-level (max 1 seq)"]
    assert orca_counterpart("request-level", "request-level", labels) == "orca"
    assert orca_counterpart("request-level (simulated)", "request-level", labels) == "orca (simulated)"
    assert orca_counterpart("request-level (max 1 seq)", "request-level", labels) == "orca"
    assert orca_counterpart("orca (simulated)", "orca", labels) is None
    assert orca_counterpart("request-level", "request-level", ["request-level"]) is None
