"""Item 6: a jobs consumer that dies holding jobs (before it acked them) loses none and makes
none run twice: JetStream hands them to the surviving consumer once their heartbeats stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import nats
import pytest

from tests.reliability.conftest import JOBS_ACK_WAIT_S
from tests.reliability.helpers import greedy_outputs, job_results, publish_job, results_stored, run
from shared.subjects import JOBS_CONSUMER, JOBS_STREAM
from tests.services.stack import ROOT, descendants

pytestmark = pytest.mark.slow


def test_a_jobs_consumer_killed_before_ack_loses_no_job_and_runs_none_twice(stack, demo_model):
    main_jobs = next(pid for pid, cmd in descendants(stack.serve.process.pid) if "services.jobs" in cmd)
    extra = subprocess.Popen([sys.executable, "-m", "services.jobs", "--nats-url", stack.nats_url,
                              "--jobs-ack-wait", str(JOBS_ACK_WAIT_S)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bodies = [{"id": f"crash-job-{i}-{time.time_ns()}", "prompt": f"x = {i}", "max_tokens": 800, "temperature": 0,
               "ignore_eos": True} for i in range(3)]

    async def go() -> tuple[dict, int, int, float]:
        nc = await nats.connect(stack.nats_url)
        js = nc.jetstream()
        stored_before = await results_stored(js)
        for line in extra.stdout:  # the extra consumer is pulling
            if "ready on" in line:
                break
        os.kill(main_jobs, signal.SIGSTOP)  # only the extra consumer takes the jobs now
        try:
            await asyncio.sleep(1.5)  # the stopped consumer's last pull request expires
            for body in bodies:
                await publish_job(js, body, 30)
            # The extra consumer holds them once JetStream counts them delivered and not acked; long
            # jobs (800 tokens each) so that it cannot have finished them by the time this is seen.
            deadline = time.monotonic() + 60
            while (await js.consumer_info(JOBS_STREAM, JOBS_CONSUMER)).num_ack_pending < len(bodies):
                assert time.monotonic() < deadline, "the extra consumer never took the jobs"
                await asyncio.sleep(0.02)
            extra.kill()  # dies holding the jobs, before any ack
            extra.wait(timeout=10)
            killed_at = time.monotonic()
        finally:
            # orca serve's supervisor may have killed and replaced the stopped consumer as hung meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.kill(main_jobs, signal.SIGCONT)
        results = await job_results(js, [b["id"] for b in bodies], JOBS_ACK_WAIT_S * 2 + 120)
        recovered_s = time.monotonic() - killed_at
        stored_after = await results_stored(js)
        await nc.close()
        return results, stored_before, stored_after, recovered_s

    try:
        results, before, after, recovered_s = run(go(), JOBS_ACK_WAIT_S * 2 + 240)
    finally:
        if extra.poll() is None:
            extra.kill()
    print(f"\njobs consumer killed holding {len(bodies)} jobs: all stored once, {recovered_s:.1f} s after the kill")
    assert set(results) == {b["id"] for b in bodies}, "a job was lost"
    assert after - before == len(bodies), "a job's result was stored twice"
    expected = greedy_outputs(demo_model, bodies)
    for body in bodies:
        assert results[body["id"]]["finish_reason"] == "length"
        assert results[body["id"]]["token_ids"] == expected[body["id"]]

