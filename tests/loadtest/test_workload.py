"""The load generator's statistics: arrival processes and dataset length distributions."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from loadtest.arrivals import arrival_times, parse_rate, parse_rates
from loadtest.datasets import (jsonl_requests, load_dataset, load_trace, orca_paper_requests, parse_range,
                            random_requests)

N = 20_000


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_rate_and_exponential_gaps():
    times = arrival_times(N, request_rate=5.0, burstiness=1.0, seed=1)
    g = gaps(times)
    assert times[0] == 0.0 and all(x >= 0 for x in g)
    assert statistics.fmean(g) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    # counts in 1 s windows are Poisson: variance equals the mean (dispersion index 1)
    counts = [0] * int(times[-1])
    for t in times:
        if t < len(counts):
            counts[int(t)] += 1
    assert statistics.fmean(counts) == pytest.approx(5.0, rel=0.03)
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    g = gaps(arrival_times(N, request_rate=2.0, burstiness=burstiness, seed=2))
    assert statistics.fmean(g) == pytest.approx(0.5, rel=0.05)
    cv = statistics.pstdev(g) / statistics.fmean(g)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)  # gamma(k): CV = 1/sqrt(k)


def test_infinite_rate_sends_everything_at_once_and_seeds_repeat():
    assert arrival_times(4, math.inf) == [0.0] * 4
    assert arrival_times(100, 3.0, seed=7) == arrival_times(100, 3.0, seed=7)
    assert arrival_times(100, 3.0, seed=7) != arrival_times(100, 3.0, seed=8)
    assert arrival_times(0, 3.0) == []


@pytest.mark.parametrize("bad", [dict(request_rate=0), dict(request_rate=-1), dict(request_rate=1, burstiness=0)])
def test_bad_arrival_parameters_are_value_errors(bad):
    with pytest.raises(ValueError):
        arrival_times(10, **bad)


def test_rates_parse_and_ramp_upwards():
    assert parse_rates("4, 1,inf,0.5,1") == [0.5, 1.0, 4.0, math.inf]
    assert math.isinf(parse_rate("inf"))
    for bad in ("0", "-2", "fast", ""):
        with pytest.raises(ValueError):
            parse_rates(bad) if bad == "" else parse_rate(bad)


def test_orca_paper_lengths_are_uniform_on_the_paper_ranges():
    requests = orca_paper_requests(8000, seed=3, vocab_size=4096)
    inputs = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert min(inputs) == 32 and max(inputs) == 512 and min(outputs) == 1 and max(outputs) == 128
    assert statistics.fmean(inputs) == pytest.approx(272, rel=0.015)
    assert statistics.fmean(outputs) == pytest.approx(64.5, rel=0.03)
    # uniform: each quarter of the range holds a quarter of the draws
    for values, (lo, hi) in ((inputs, (32, 512)), (outputs, (1, 128))):
        width = (hi - lo + 1) / 4
        quarters = [sum(1 for v in values if lo + i * width <= v < lo + (i + 1) * width) for i in range(4)]
        assert all(q / len(values) == pytest.approx(0.25, abs=0.02) for q in quarters)
    assert all(r.ignore_eos and r.temperature == 0.0 for r in requests)
    assert all(10 <= t < 4096 for r in requests[:200] for t in r.prompt_token_ids)


def test_random_dataset_ranges_and_seeds():
    fixed = random_requests(50, (7, 7), (3, 3), seed=0)
    assert {len(r.prompt_token_ids) for r in fixed} == {7} and {r.max_tokens for r in fixed} == {3}
    a = load_dataset("random", 20, seed=5, input_range=(10, 20), output_range=(1, 4))
    assert a == load_dataset("random", 20, seed=5, input_range=(10, 20), output_range=(1, 4))
    assert a != load_dataset("random", 20, seed=6, input_range=(10, 20), output_range=(1, 4))
    assert parse_range("32:512") == (32, 512) and parse_range("16") == (16, 16)
    for bad in ("0:4", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_jsonl_dataset_reads_generate_input_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "hello", "max_tokens": 5}\n\n'
                    '{"id": "b", "prompt_token_ids": [11, 12], "ignore_eos": true}\n{"id": "c", "prompt": "x"}\n')
    requests = jsonl_requests(path, num_prompts=2)
    assert [r.id for r in requests] == ["a", "b"] and requests[0].max_tokens == 5 and requests[1].ignore_eos
    path.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "max_tokens": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        jsonl_requests(path)


def test_trace_file_is_sorted_by_arrival(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 2.0, "prompt_len": 5, "output_len": 2}, {"arrival_s": 0.5, "prompt_len": 3, "output_len": 9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    requests, arrivals = load_trace(path)
    assert arrivals == [0.5, 2.0]
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in requests] == [(3, 9), (5, 2)]


def test_a_workload_file_that_is_not_there_is_a_value_error_naming_its_flag(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=f"--dataset-path {missing}: No such file or directory"):
        load_dataset("jsonl", 4, path=str(missing))
    with pytest.raises(ValueError, match=f"--trace {missing}: No such file or directory"):
        load_trace(missing)
