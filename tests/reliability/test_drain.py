"""Issue #10, item 11: graceful drain on SIGTERM. Requests in flight (NATS and HTTP) finish whole
within the drain timeout, new ones are refused at once (HTTP 503, a NATS error event), `orca
serve` exits 0, and no process it started (services, Ray, the gateway) survives it.

Runs last among the reliability tests: it stops the shared stack."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.reliability.conftest import DRAIN_TIMEOUT_S
from tests.reliability.helpers import Session, connect, greedy_outputs, long_requests, run, stream, tokens_of

pytestmark = [pytest.mark.slow, pytest.mark.stops_stack]

MAX_TOKENS = 300
"""Long enough that the requests in flight outlast the refusal checks below on any machine."""


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_leaves_no_process(stack, demo_model):
    bodies = long_requests("drain", 3, MAX_TOKENS)
    expected = greedy_outputs(demo_model, bodies)
    serve = stack.serve
    session = Session(serve.process.pid).snapshot()
    assert any(cmd.startswith("ray::Worker") for _, cmd in session.processes.values()), session.processes

    async def go() -> dict:
        nc = await connect(stack.nats_url)
        figures: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as client:
            http_body = {"prompt": "import os", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            tasks = [asyncio.create_task(stream(nc, b, timeout_s=60)) for b in bodies]
            http_tasks = [asyncio.create_task(client.post("/v1/completions", json=http_body)) for _ in range(2)]
            await asyncio.sleep(0.5)  # all of them are in flight
            serve.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)  # orca serve has passed the signal on
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            figures["refused_after_s"] = time.monotonic() - signalled
            late = await stream(nc, {"id": "late", "prompt": "hi", "max_tokens": 4}, timeout_s=10)
            figures["late_refused_s"] = time.monotonic() - signalled
            results = await asyncio.gather(*tasks)
            http_results = await asyncio.gather(*http_tasks)
            figures["in_flight_done_s"] = time.monotonic() - signalled
        await nc.close()
        rc = await asyncio.to_thread(serve.process.wait, DRAIN_TIMEOUT_S + 60)
        figures["exited_s"] = time.monotonic() - signalled
        return {"figures": figures, "refused": refused, "late": late, "results": results, "http": http_results,
                "rc": rc}

    out = run(go(), DRAIN_TIMEOUT_S + 120)
    print("drain:", {k: round(v, 2) for k, v in out["figures"].items()}, f"{len(session.processes)} processes")
    figures = out["figures"]
    assert figures["late_refused_s"] < figures["in_flight_done_s"], "the refusals must come while requests still run"
    assert out["refused"].status_code == 503, out["refused"].text
    assert out["late"][-1]["finish_reason"] == "error" and "shutting down" in out["late"][-1]["error"], out["late"]
    for body, events in zip(bodies, out["results"]):
        assert events[-1]["finish_reason"] == "length", events[-1]
        assert tokens_of(events) == expected[body["id"]], body["id"]
    for response in out["http"]:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert out["rc"] == 0, "".join(serve.log[-40:])
    deadline = time.monotonic() + 15  # a killed child may take a moment to be reaped
    while session.survivors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session.survivors(), session.survivors()
