"""Issue #10, item 2: an engine-wide fault, a forward pass that raises (injected through
ORCA_TEST_FAULT_FILE, which the worker reads before each step). Every request in flight gets an
error event within seconds; /health answers 503 and new HTTP requests are refused at once while
the worker process is restarted (by Ray); then the engine serves again.

Needs the engine side of the fault injection and the restart (/tmp/reliability-engine.patch)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.reliability.helpers import (assert_worker_replaced, long_requests, run, streaming, timed_completion,
                                       wait_for_health)
from tests.services.stack import worker_pids

pytestmark = pytest.mark.slow


def inject(path, command: str) -> None:
    """Atomically, so the worker never reads half a command."""
    staging = path.with_suffix(".tmp")
    staging.write_text(command)
    os.replace(staging, path)


def test_a_forward_pass_that_raises_errors_every_request_and_the_engine_restarts(stack):
    bodies = long_requests("fault", 3, 300)
    [worker] = worker_pids(stack.serve)

    async def go() -> dict:
        figures: dict[str, float] = {}
        async with streaming(stack.nats_url, stack.http_url, bodies, timeout_s=60) as (client, tasks):
            inject(stack.fault_file, "raise")
            faulted_at = time.monotonic()
            results = await asyncio.gather(*tasks)
            figures["errors_in_s"] = time.monotonic() - faulted_at
            await wait_for_health(client, 503, 10)
            figures["unhealthy_s"] = time.monotonic() - faulted_at
            refused, figures["refused_in_s"] = await timed_completion(client, "hi")
            await wait_for_health(client, 200, 120)
            figures["recovered_s"] = time.monotonic() - faulted_at
            after = await client.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 4})
        return {"figures": figures, "results": results, "refused": refused, "after": after}

    out = run(go(), 240)
    print("forward pass raised:", {k: round(v, 2) for k, v in out["figures"].items()})
    assert not stack.fault_file.exists(), "the fault fired"
    for events in out["results"]:
        final = events[-1]
        assert final["finish_reason"] == "error" and "injected fault" in final["error"], final
        assert sum(e["finish_reason"] is not None for e in events) == 1
        assert 0 < final["usage"]["completion_tokens"] < 300
    assert out["figures"]["errors_in_s"] < 5
    assert out["refused"].status_code == 503 and out["refused"].headers["retry-after"], out["refused"].text
    assert out["figures"]["refused_in_s"] < 1.0
    assert out["after"].status_code == 200, out["after"].text
    assert_worker_replaced(stack, worker)
    said = "".join(stack.serve.log)
    assert "ERROR orca.engine: engine 0: step failed" in said and "injected fault" in said, \
        "the operator's terminal shows the engine's error (Ray forwards the actors' output)"
