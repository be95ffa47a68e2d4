"""A worker's step result leaves at once, on a real nats-server, even when the next step is already
waiting: under async scheduling the master sends iteration N+1 while the worker runs N, and N's result
(the request's next token) must not wait for N+1's forward pass.

Its waits are long on purpose: `make test` runs it at nice 19 beside tests/reliability, which can take
both cores for tens of seconds, and a starved run must not read as a held-back result. A result that is
held back is released only when step 1 ends, so a real failure still shows (after STEP_WAIT_S)."""

import asyncio
import threading

import nats

from core.batch import RunnerOutput, SchedulerOutput, StepResult
from services.engine.worker_actor import Worker
from shared import subjects
from shared.codec import Codec
from shared.config import EngineConfig, ModelConfig

STEP_WAIT_S = 60.0
"""How long step 1 waits to hear that step 0's result was received."""
TEST_TIMEOUT_S = 180.0


class WatchedRunner:
    """Step 1 waits (up to STEP_WAIT_S) until someone outside the worker has received step 0's result."""

    def __init__(self, first_result_seen: threading.Event) -> None:
        self.requests: dict = {}
        self.first_result_seen = first_result_seen
        self.seen_in_time: bool | None = None

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        if step.iteration == 1:
            self.seen_in_time = self.first_result_seen.wait(timeout=STEP_WAIT_S)
        return RunnerOutput({"r": step.iteration})


def listen_for_results(url: str, seen: threading.Event, subscribed: threading.Event, stop: threading.Event) -> None:
    """In a thread of its own: the worker's event loop is busy while a step runs."""

    async def main() -> None:
        nc = await nats.connect(url)

        async def on_result(msg) -> None:
            if Codec(StepResult).decode(msg.data).iteration == 0:
                seen.set()

        await nc.subscribe(subjects.engine_result("0"), cb=on_result)
        await nc.flush()
        subscribed.set()
        while not stop.is_set():
            await asyncio.sleep(0.01)
        await nc.close()

    asyncio.run(main())


def test_a_result_is_on_the_wire_before_the_next_waiting_step_runs(nats_url):
    seen, subscribed, stop = threading.Event(), threading.Event(), threading.Event()
    listener = threading.Thread(target=listen_for_results, args=(nats_url, seen, subscribed, stop), daemon=True)
    listener.start()
    assert subscribed.wait(TEST_TIMEOUT_S)
    worker = Worker(EngineConfig(model=ModelConfig(model="unused")), nats_url, "0", max_model_len=64)
    worker.runner = WatchedRunner(seen)

    async def main() -> None:
        serving = asyncio.create_task(worker.serve())
        await worker.wait_subscribed()
        nc = await nats.connect(nats_url)
        for iteration in (0, 1):  # back to back: step 1 is queued while step 0 runs
            await nc.publish(subjects.engine_step("0"), Codec.encode(SchedulerOutput(iteration, [], [], [])))
        await nc.flush()
        while worker.last_iteration != 1:
            await asyncio.sleep(0.01)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await nc.close()

    try:
        asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT_S))
    finally:
        stop.set()
        listener.join(TEST_TIMEOUT_S)
    assert worker.runner.seen_in_time, "step 0's result was held back until step 1 had run"


def test_the_steps_sent_ahead_of_a_failed_one_are_not_run_until_the_reset():
    """Under async scheduling step N+1 is on its way when N fails: it builds on state N never made, so it
    fails without running (one line, not a second traceback, a KeyError), until the master resets."""
    import logging

    class FailingOnce:
        def __init__(self) -> None:
            self.requests: dict = {}
            self.ran: list[int] = []

        def execute(self, step: SchedulerOutput) -> RunnerOutput:
            self.ran.append(step.iteration)
            if step.iteration == 0:
                raise RuntimeError("boom")
            return RunnerOutput({"r": step.iteration})

    worker = Worker(EngineConfig(model=ModelConfig(model="unused")), "nats://unused", "0", 64)
    logging.getLogger().handlers.clear()  # Worker's setup_logging wrote to stderr; keep pytest's capture
    worker.runner, worker.fault_file = FailingOnce(), None
    failed, ahead = worker._execute(SchedulerOutput(0, [], [], [])), worker._execute(SchedulerOutput(1, [], [], []))
    assert "RuntimeError: boom" in failed.error
    assert ahead.error == "rank 0: step 0 failed before this one" and worker.runner.ran == [0]
    asyncio.run(worker.reset())
    assert worker._execute(SchedulerOutput(2, [], [], [])).output == RunnerOutput({"r": 2})
