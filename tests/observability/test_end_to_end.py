"""Observability end to end: `orca serve` (real nats-server, real local Ray, Ray Serve gateway) with a
second tokenizer instance, every process exporting its spans as JSON lines to one file
(ORCA_TRACES_EXPORTER=jsonl:<path>), and the gateway's /metrics scraped under load.

One engine replica keeps the start-up short on two cores; summing several replicas' and restarted
processes' snapshots is tested on the real collector in test_metrics_board.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.helpers import GatewayServe
from tests.services.stack import ROOT, stream

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 3
LOAD_TOKENS = 60
"""Tokens per load request, plus i % 5: enough that the load outlasts a few metric snapshots (0.3 s
apart), so the scraper sees requests running (with 4 tokens the load sometimes ended between two)."""
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def observed(demo_model, tmp_path_factory):
    spans_file = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    env = {"ORCA_TRACES_EXPORTER": f"jsonl:{spans_file}", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "ORCA_METRICS_INTERVAL_S": "0.3"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # `orca serve` and every process it starts (Ray actors too) inherit them
    try:
        serve = GatewayServe(["--model", demo_model, "--replicas", "1", "--max-num-seqs", str(MAX_NUM_SEQS),
                              "--kv-cache-tokens", "4096", "--worker-threads", "1"])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    second_tokenizer = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--nats-url", serve.nats_url, "--model", demo_model],
        cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serve.spans_file = spans_file
    serve.model = demo_model
    try:
        wait_for(lambda: sources(scrape(serve)) == {"tokenizer": 2, "admission": 1, "engine": 1}, 60,
                 "both tokenizers, admission and the engine publish metrics", lambda: str(sources(scrape(serve))))
        yield serve
    finally:
        second_tokenizer.terminate()
        second_tokenizer.wait(timeout=20)
        assert serve.stop() == 0


# ---- helpers -------------------------------------------------------------------------------------

def wait_for(condition, timeout_s: float, what: str, show=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting until {what} {show()}")


def scrape(serve) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, sorted labels) -> value."""
    text = httpx.get(serve.http_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    samples[("__text__", ())] = text
    return samples


def total(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def per_engine(samples, name: str) -> dict[str, float]:
    return {dict(ls)["engine"]: v for (n, ls), v in samples.items() if n == name}


def sources(samples) -> dict[str, float]:
    """Processes whose snapshots the gateway hears, by kind."""
    return {dict(ls)["kind"]: v for (n, ls), v in samples.items() if n == "orca:metrics_sources"}


def read_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- one connected trace -------------------------------------------------------------------------

def test_one_request_is_one_connected_trace_across_the_services(observed):
    response = httpx.post(observed.http_url + "/v1/completions", timeout=60, json={
        "model": observed.model, "prompt": "def main():", "max_tokens": 5, "temperature": 0, "top_p": 0.9,
        "ignore_eos": True}, headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]

    def trace_complete():
        spans = read_spans(observed.spans_file)
        mine = [s for s in spans if s["trace_id"] == TRACE_ID]
        names = {s["name"] for s in mine}
        request = next((s for s in mine if s["name"].startswith("text_completion")), None)
        if request is None or "orca.engine.request" not in names or "POST /v1/completions" not in names:
            return None
        linked = [s for s in spans if s["name"] == "orca.iteration"
                  and any(link["span_id"] == request["span_id"] for link in s["links"])]
        return (mine, request, linked) if len(linked) >= usage["completion_tokens"] else None

    mine, request, iterations = wait_for(trace_complete, 20, "the request's spans are exported")
    by_id = {s["span_id"]: s for s in mine}
    # connected: one root (the HTTP span, whose parent is the caller's), every other span's parent is in the trace
    roots = [s for s in mine if s["parent_span_id"] not in by_id]
    assert [(r["name"], r["parent_span_id"]) for r in roots] == [("POST /v1/completions", CALLER_SPAN_ID)]
    assert {s["service"] for s in mine} == {"orca-gateway", "orca-tokenizer", "orca-admission", "orca-engine"}

    a = request["attributes"]
    assert request["parent_span_id"] == roots[0]["span_id"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == Path(observed.model).name
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (5, 0, 0.9)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert [e["name"] for e in request["events"]] == ["gen_ai.first_token"]
    children = {s["name"]: s for s in mine if s["parent_span_id"] == request["span_id"]}
    assert set(children) == {"tokenize", "orca.admission.queue", "orca.engine.request", "detokenize"}
    assert request["start_ns"] <= children["tokenize"]["start_ns"] <= children["orca.admission.queue"]["start_ns"]
    assert children["orca.admission.queue"]["end_ns"] <= children["orca.engine.request"]["end_ns"] \
        <= request["end_ns"]
    engine = children["orca.engine.request"]
    assert [e["name"] for e in engine["events"]] == ["scheduled", "first_token"]

    # one prefill iteration, then one per fed-back token: as many iterations as tokens generated
    assert len(iterations) == usage["completion_tokens"]
    indices = sorted(s["attributes"]["orca.iteration.index"] for s in iterations)
    assert indices == list(range(indices[0], indices[0] + len(indices)))
    assert {s["attributes"]["orca.replica"] for s in iterations} == {engine["attributes"]["orca.replica"]}
    first = min(iterations, key=lambda s: s["attributes"]["orca.iteration.index"])["attributes"]
    assert first["orca.num_prefill_tokens"] == usage["prompt_tokens"] and first["orca.num_decode_tokens"] == 0
    for s in iterations:
        attrs = s["attributes"]
        assert s["parent_span_id"] is None and s["trace_id"] != TRACE_ID  # linked, not parented
        assert attrs["orca.batch_size"] == 1 and attrs["orca.policy"] == "orca"
        assert attrs["orca.kv.used_blocks"] + attrs["orca.kv.free_blocks"] > 0
        assert s["end_ns"] > s["start_ns"]


def test_a_chat_over_http_is_traced_as_a_chat(observed):
    """The gateway renders a chat into token ids itself: the tokenizer's span still says chat (gen_ai.operation.name)."""
    trace_id = "5c" * 16
    response = httpx.post(observed.http_url + "/v1/chat/completions", timeout=60, json={
        "model": observed.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"})
    assert response.status_code == 200, response.text

    def request_span():
        return next((s for s in read_spans(observed.spans_file) if s["trace_id"] == trace_id
                     and s.get("service") == "orca-tokenizer" and s["parent_span_id"] is not None
                     and "gen_ai.operation.name" in s["attributes"]), None)

    span = wait_for(request_span, 20, "the chat's request span is exported")
    assert span["attributes"]["gen_ai.operation.name"] == "chat"
    assert span["name"] == f"chat {Path(observed.model).name}"


# ---- metrics under load --------------------------------------------------------------------------

COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
            "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
            "vllm:request_queue_time_seconds_count", "vllm:iteration_tokens_total_sum",
            "vllm:iteration_tokens_total_count", "orca:batch_size_sum", "orca:iterations_total",
            "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
            "vllm:request_inference_time_seconds_count", "vllm:request_time_per_output_token_seconds_count",
            "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
            "vllm:request_params_max_tokens_sum"]


def test_metrics_under_load_match_what_was_sent(observed):
    before = wait_for(lambda: quiescent(observed), 15, "the counters stop moving")  # earlier tests' last snapshots
    base = figures(before)
    assert per_engine(before, "orca:kv_total_slots") == {"0": 4096}

    seen = defaultdict(list)
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            s = scrape(observed)
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                         "orca:kv_reserved_slots", "orca:kv_used_slots"):
                seen[name].append(per_engine(s, name))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    num = 14
    try:
        results = asyncio.run(send_load(observed, num))
    finally:
        stop.set()
        watcher.join()
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    completion_tokens = sum(r["completion_tokens"] for r in results)
    assert completion_tokens == sum(LOAD_TOKENS + i % 5 for i in range(num))  # ignore_eos: exactly max_tokens

    # while it ran: running within each engine's bound, KV usage a fraction, reservation >= use
    assert seen["vllm:num_requests_running"]
    assert max(sum(v for k, v in s.items()) for s in seen["vllm:num_requests_running"]) > 0
    for sample in seen["vllm:num_requests_running"]:
        assert all(0 <= v <= MAX_NUM_SEQS for v in sample.values()) and set(sample) == {"0"}
    assert all(v >= 0 for s in seen["vllm:num_requests_waiting"] for v in s.values())
    assert all(0 <= v <= 1 for s in seen["vllm:kv_cache_usage_perc"] for v in s.values())
    assert max(v for s in seen["vllm:kv_cache_usage_perc"] for v in s.values()) > 0
    for reserved, used in zip(seen["orca:kv_reserved_slots"], seen["orca:kv_used_slots"]):
        assert all(reserved.get(k, 0) >= used[k] for k in used)

    # one request admission can never serve (its prompt fills the context), sent straight over NATS
    context = httpx.get(observed.http_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    asyncio.run(send_unservable(observed.nats_url, context))

    expected = {
        "vllm:prompt_tokens_total": prompt_tokens,  # not the unservable one's: no engine read them
        "vllm:generation_tokens_total": completion_tokens,
        "vllm:e2e_request_latency_seconds_count": num + 1,
        "vllm:time_to_first_token_seconds_count": num,
        "vllm:inter_token_latency_seconds_count": completion_tokens - num,
        "vllm:request_queue_time_seconds_count": num,
        # an iteration computes the prompts and every generated token but the last of each request
        "vllm:iteration_tokens_total_sum": prompt_tokens + completion_tokens - num,
        "orca:batch_size_sum": completion_tokens,  # one batch slot per generated token
        # vLLM's request phases, one sample per request the engine served (each made more than one token)
        **dict.fromkeys(["vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                         "vllm:request_inference_time_seconds_count",
                         "vllm:request_time_per_output_token_seconds_count"], num),
        "vllm:request_prompt_tokens_sum": prompt_tokens, "vllm:request_generation_tokens_sum": completion_tokens,
        "vllm:request_params_max_tokens_sum": completion_tokens,  # ignore_eos: each made its max_tokens
        "length": num, "error": 1, "unservable": 1,
    }
    # snapshots come from four processes at their own pace: wait until each has told its part
    def complete():
        samples = scrape(observed)
        return samples if delta(samples, base, expected) == expected else None

    after = wait_for(complete, 15, "the metrics take in every request",
                     lambda: str(delta(scrape(observed), base, expected)))
    assert delta(after, base, expected) == expected
    d = {k: figures(after)[k] - base[k] for k in base}
    assert d["vllm:iteration_tokens_total_count"] == d["orca:iterations_total"] > 0
    assert total(after, "vllm:num_requests_running") == total(after, "vllm:num_requests_waiting") == 0
    assert total(after, "orca:kv_reserved_slots") == 0  # KV back to 0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "orca:kv_used_slots"):
        assert per_engine(after, name) == {"0": 0.0}
    text = after[("__text__", ())]
    assert "orca:http_requests_total" in text and "orca:admission_queue_len" in text  # the gateway's own


def figures(samples) -> dict[str, float]:
    out = {name: total(samples, name) for name in COUNTERS}
    out["length"] = total(samples, "vllm:request_success_total", finished_reason="length")
    out["error"] = total(samples, "vllm:request_success_total", finished_reason="error")
    out["unservable"] = total(samples, "orca:admission_rejections_total", reason="unservable")
    return out


def delta(samples, base: dict[str, float], keys) -> dict[str, float]:
    now = figures(samples)
    return {k: now[k] - base[k] for k in keys}


def quiescent(serve):
    """A scrape whose counters equal those of one a second later, with no request running."""
    first = scrape(serve)
    time.sleep(1.0)
    second = scrape(serve)
    idle = total(second, "vllm:num_requests_running") == 0
    return second if idle and figures(first) == figures(second) else None


async def send_load(serve, num: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=serve.http_url, timeout=120) as client:
        async def one(i: int) -> dict:
            r = await client.post("/v1/completions", json={
                "model": serve.model, "prompt": f"request {i}: " + "x " * (i % 7), "max_tokens": LOAD_TOKENS + i % 5,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["usage"]
        return await asyncio.gather(*(one(i) for i in range(num)))


async def send_unservable(nats_url: str, context: int) -> None:
    nc = await nats.connect(nats_url)
    try:
        events = await stream(nc, {"id": "too-long", "prompt_token_ids": [5] * context, "max_tokens": 1})
    finally:
        await nc.close()
    assert events[-1]["finish_reason"] == "error" and "context" in events[-1]["error"]
