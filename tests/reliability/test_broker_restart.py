"""Issues #10 (item 5) and #20: the NATS server is killed mid-load and started again (same port, same
JetStream file store). Every client reconnects. Durable jobs are neither lost nor stored twice, and
their results are whole. The streams in flight keep running in the engine while the bus is away, and
arrive whole: every core-NATS stream (clients following the README's rule) and every HTTP request
carries its whole output, the same tokens as the in-process engine. Then the system serves again."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.reliability.helpers import (connect, greedy_outputs, job_results, long_requests, publish_job, results_stored,
                                       run, stream, tokens_of, wait_engines_idle)

pytestmark = pytest.mark.slow

DOWN_S = 4.0
"""Past the engines' status expiry (3 s): every service hears nobody for longer than a heartbeat
expiry, and must not take its own outage for the engines' death (a request resumed onto an engine
that was alive all along waited for ever)."""
STREAM_TOKENS = 900
"""Long enough that the streams are still running when the broker goes down, on a fast engine too (80
tokens all finished within the test's first second once the engine got faster); the test checks it."""


def test_a_broker_restart_mid_load_loses_nothing_and_cuts_nothing(stack, demo_model):
    streams = long_requests("bus", 6, STREAM_TOKENS)
    jobs = [{"id": f"bus-job-{i}", "prompt": f"y = {i}", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
            for i in range(4)]
    expected = greedy_outputs(demo_model, streams + jobs)

    async def go() -> dict:
        nc = await connect(stack.nats_url)
        js = nc.jetstream()
        stored_before = await results_stored(js)
        figures: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=120) as client:
            http_body = {"prompt": "import os", "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}
            arrivals: dict[str, list[float]] = {b["id"]: [] for b in streams}
            stats: dict[str, int] = {}
            tasks = [asyncio.create_task(stream(nc, b, timeout_s=120, stats=stats,
                                                on_event=lambda e: arrivals[e["id"]].append(time.monotonic())))
                     for b in streams]
            http_tasks = [asyncio.create_task(client.post("/v1/completions", json=http_body)) for _ in range(2)]
            for job in jobs:
                await publish_job(js, job, 30)
            await asyncio.sleep(1.0)  # everything is in flight
            figures["streams_running_at_restart"] = sum(not t.done() for t in tasks + http_tasks)
            await asyncio.to_thread(stack.broker.restart, DOWN_S)
            restarted_at = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            http_results = await asyncio.gather(*http_tasks, return_exceptions=True)
            figures["streams_ended_s"] = time.monotonic() - restarted_at
            resumed = [next((t for t in times if t > restarted_at), None) for times in arrivals.values()]
            figures["streams_resumed_s"] = max(t - restarted_at for t in resumed if t is not None)
            figures.update({f"client_{k}": v for k, v in stats.items()})
            stored = await job_results(js, [j["id"] for j in jobs], 180)
            figures["jobs_done_s"] = time.monotonic() - restarted_at
            after = await served_again(nc, deadline_s=30)
            figures["serving_again_s"] = time.monotonic() - restarted_at
            stored_after = await results_stored(js)
        await nc.close()
        return {"figures": figures, "results": results, "http": http_results, "jobs": stored,
                "stored": stored_after - stored_before, "after": after}

    out = run(go(), 420)
    assert out["figures"]["streams_running_at_restart"] > 0, "the load ended before the broker went down"
    finals = [r[-1]["finish_reason"] if isinstance(r, list) else repr(r) for r in out["results"]]
    codes = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in out["http"]]
    print("broker restart:", {k: round(v, 2) for k, v in out["figures"].items()}, "streams:", finals, "http:", codes)
    for body, events in zip(streams, out["results"]):
        assert isinstance(events, list), f"{body['id']} never ended: {events!r}"
        assert sum(e["finish_reason"] is not None for e in events) == 1
        assert [e.get("seq", 0) for e in events] == list(range(len(events)))
        assert events[-1]["finish_reason"] == "length", f"{body['id']} ended with {events[-1]}"
        assert tokens_of(events) == expected[body["id"]], f"{body['id']}: not the in-process engine's tokens"
    for response in out["http"]:
        assert isinstance(response, httpx.Response), f"an HTTP request never ended: {response!r}"
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == STREAM_TOKENS
    assert sorted(out["jobs"]) == sorted(j["id"] for j in jobs), "a job was lost"
    for job in jobs:
        result = out["jobs"][job["id"]]
        assert result["finish_reason"] == "length" and result["token_ids"] == expected[job["id"]], result
    assert out["stored"] == len(jobs), "a job's result was stored twice"
    assert out["after"][-1]["finish_reason"] == "length"

    wait_engines_idle(stack.nats_url, 60)  # interrupted requests were aborted: their KV is free


async def served_again(nc, deadline_s: float) -> list[dict]:
    """A new request, sent as the README's client rule says: one refused while the services are still
    reconnecting (an error event at once) is sent again, until one is served or `deadline_s` passes."""
    deadline = time.monotonic() + deadline_s
    attempt = 0
    while True:
        attempt += 1
        events = await stream(nc, {"id": f"bus-after-{attempt}", "prompt": "hi", "max_tokens": 4}, timeout_s=30)
        if events[-1]["finish_reason"] != "error" or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.5)
