"""Issue #10, item 7: a hung forward pass. The worker process is stopped (SIGSTOP): alive but
silent, as a worker stuck in a kernel or a collective is, so only the engine master's step
watchdog (`--step-timeout`) can see it. It is then handled as a dead worker: Ray restarts it and
the requests resume by recompute, with the same tokens as if nothing had happened."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.reliability.conftest import STEP_TIMEOUT_S
from tests.reliability.helpers import (assert_worker_replaced, greedy_outputs, long_requests, run, streaming,
                                       timed_completion, tokens_of, wait_for_health)
from tests.services.stack import worker_pids

pytestmark = pytest.mark.slow


def test_a_hung_forward_pass_is_detected_and_its_requests_resume(stack, demo_model):
    bodies = long_requests("hung", 3, 300)  # still running when the worker stops, however fast the model
    expected = greedy_outputs(demo_model, bodies)
    [victim] = worker_pids(stack.serve)

    async def go() -> dict:
        figures: dict[str, float] = {}
        async with streaming(stack.nats_url, stack.http_url, bodies, timeout_s=120) as (client, tasks):
            os.kill(victim, signal.SIGSTOP)
            hung_at = time.monotonic()
            killed = asyncio.create_task(gone_after(victim, hung_at))
            figures["detected_s"] = await wait_for_health(client, 503, STEP_TIMEOUT_S + 10)
            refused, figures["refused_in_s"] = await timed_completion(client, "hi")
            assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
            await wait_for_health(client, 200, 120)
            figures["recovered_s"] = time.monotonic() - hung_at
            results = await asyncio.gather(*tasks)
            figures["all_finished_s"] = time.monotonic() - hung_at
            figures["killed_s"] = await killed
            after = await client.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 4})
            assert after.status_code == 200, after.text
        return {"figures": figures, "results": results}

    out = run(go(), 240)
    print("hung forward pass:", {k: round(v, 2) for k, v in out["figures"].items()})
    for body, events in zip(bodies, out["results"]):
        assert events[-1]["finish_reason"] == "length", events[-1]
        assert tokens_of(events) == expected[body["id"]], body["id"]
    assert out["figures"]["detected_s"] < STEP_TIMEOUT_S + 5
    assert out["figures"]["refused_in_s"] < 1.0
    # Ray SIGKILLs it 1 s after the master's kill (services/local_ray.py RAY_SETTINGS; Ray's default: 5 s)
    assert out["figures"]["killed_s"] < STEP_TIMEOUT_S + 3.5, out["figures"]
    assert_worker_replaced(stack, victim)


def test_a_worker_killed_while_the_engine_is_idle_is_restarted_before_a_request_needs_it(stack):
    """The master watches its worker's `serve` call between steps too: it restarts a dead worker at once
    (/health 503 meanwhile), so the next request does not wait for the restart."""
    [victim] = worker_pids(stack.serve)

    async def go() -> dict:
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as client:
            await wait_for_health(client, 200, 60)
            os.kill(victim, signal.SIGKILL)
            figures = {"unhealthy_s": await wait_for_health(client, 503, 10)}
            figures["healthy_again_s"] = figures["unhealthy_s"] + await wait_for_health(client, 200, 60)
            response, figures["next_request_s"] = await timed_completion(client, "def f():")
            assert response.status_code == 200, response.text
        return figures

    figures = run(go(), 120)
    print("worker killed while idle:", {k: round(v, 2) for k, v in figures.items()})
    assert figures["next_request_s"] < 2.0, figures
    assert_worker_replaced(stack, victim)


async def gone_after(pid: int, since: float) -> float:
    """Seconds from `since` until the process is gone (a zombie counts as gone: it runs nothing)."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    break
        except OSError:
            break
        await asyncio.sleep(0.05)
    return time.monotonic() - since
