"""A worker: one device's model shard, KV cache and sampler, driven by step messages.

Ray owns its lifecycle (it restarts one that dies); the engine master drives it with one
step message per iteration on NATS. Under tensor/pipeline parallelism every worker of the
engine gets every step and runs its stage's part of it, exchanging tensors with its peers
over torch.distributed; only the output rank answers, with one result message. A worker
that fails a step answers too (with the error), so the master never waits out a timeout.

Step messages may be lost while NATS is away, or arrive twice (the master sends the iterations in
flight again after a reconnect): a worker runs each iteration once, in order, answers a repeat with
the result it kept, holds an iteration that arrives before the one it lacks, and after its own
reconnect tells the master the last iteration it ran (`WorkerResync`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import traceback
from collections import OrderedDict
from pathlib import Path

from core.batch import SchedulerOutput, StepResult
from shared.parallel import ParallelRank
from shared import env, subjects
from shared.codec import Codec
from services.cpu_binding import bind_this_process, place_openmp_threads
from services.logs import setup_logging
from shared.config import EngineConfig
from shared.messages import WorkerResync

log = logging.getLogger("orca.worker")
step_codec = Codec(SchedulerOutput)
RESULTS_KEPT = 8
"""Results kept to answer a repeated step (more than the master ever has in flight)."""


class Worker:
    def __init__(self, config: EngineConfig, nats_url: str, replica: str, max_model_len: int,
                 num_threads: int | None = None, rank: int = 0, cores: tuple[int, ...] | None = None,
                 borrow_cores: tuple[int, ...] = ()) -> None:
        setup_logging()  # a Ray actor process: timestamps and INFO lines in its log, as every service has
        self.borrowed_threads = 0
        if cores:
            self.borrowed_threads = place_openmp_threads(cores, borrow_cores)  # before the binding: see there
            bind_this_process(cores)  # before the model loads: its threads start here
        self.config, self.nats_url, self.replica = config, nats_url, replica
        self.max_model_len = max_model_len
        self.num_threads = num_threads
        parallel = config.parallel
        self.rank = ParallelRank.of(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.runner = None
        self.fault_file = env.fault_injection_file()  # tests only; None in production
        self.failed_step: int | None = None
        """The step that failed since the last reset: the request state the steps after it build on is gone."""
        self._subscribed = asyncio.Event()
        self._steps: asyncio.Queue = asyncio.Queue()
        self.last_iteration: int | None = None
        """The last iteration run (None before the first, after a (re)start)."""
        self._results: OrderedDict[int, bytes] = OrderedDict()
        self._ahead: dict[int, SchedulerOutput] = {}

    def rendezvous_address(self) -> str:
        """A tcp:// address on this worker's node for the engine's torch.distributed group."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    async def load(self, init_method: str = "") -> None:
        if self.runner is None:
            self.runner = await asyncio.to_thread(self._build_runner, init_method)

    def _build_runner(self, init_method: str):
        import torch

        from engine.executor import RunnerArgs
        from model.distributed import init_distributed

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        groups = init_distributed(self.rank, init_method, self.config.model.device)
        args = RunnerArgs(self.config, self.max_model_len, borrowed_threads=self.borrowed_threads)
        return args.build(groups)

    async def wait_subscribed(self) -> None:
        await self._subscribed.wait()

    async def serve(self) -> None:
        """Execute step messages in order until the connection closes."""
        from services.bus import connect

        if self._subscribed.is_set():
            return  # already serving: one loop per worker
        from services.bus import on_reconnect, sent, synced

        nc = await connect(self.nats_url, f"orca-worker-{self.replica}-{self.rank.rank}")
        self.runner.requests.clear()  # a (re)start begins with no request state
        self.last_iteration, self._results, self._ahead = None, OrderedDict(), {}
        await nc.subscribe(subjects.engine_step(self.replica), cb=self._enqueue)
        on_reconnect(nc, lambda: asyncio.get_running_loop().create_task(self._resync(nc)))
        await synced(nc)  # the master sends the first step as soon as it hears this worker is subscribed
        self._subscribed.set()
        try:
            while True:
                answers = self.take(step_codec.decode(await self._steps.get()))
                for data in answers:
                    await nc.publish(subjects.engine_result(self.replica), data)
                if answers:  # out before the next step, which may be waiting already (async scheduling)
                    await sent(nc)
        finally:
            self._subscribed.clear()
            await nc.close()

    async def _enqueue(self, msg) -> None:
        await self._steps.put(msg.data)

    async def _resync(self, nc) -> None:
        last = -1 if self.last_iteration is None else self.last_iteration
        await nc.publish(subjects.engine_resync(self.replica), Codec.encode(WorkerResync(self.rank.rank, last)))

    def take(self, step: SchedulerOutput) -> list[bytes]:
        """Run a step message, once and in order: the encoded results to send (a repeat's kept one;
        none from a rank that does not answer, or for a step held until the one before it arrives)."""
        iteration, last = step.iteration, self.last_iteration
        if last is not None and iteration <= last:
            kept = self._results.get(iteration)
            return [kept] if kept is not None else []
        if last is not None and iteration > last + 1:
            self._ahead[iteration] = step
            return []
        answers = []
        while step is not None:
            result = self._execute(step)
            self.last_iteration = step.iteration
            if result is not None:
                data = Codec.encode(result)
                self._results[step.iteration] = data
                while len(self._results) > RESULTS_KEPT:
                    self._results.popitem(last=False)
                answers.append(data)
            step = self._ahead.pop(step.iteration + 1, None)
        return answers

    def _execute(self, scheduler_output: SchedulerOutput) -> StepResult | None:
        start = time.perf_counter()
        if self.failed_step is not None:  # sent ahead (async scheduling) before the master heard of the failure
            error = f"rank {self.rank.rank}: step {self.failed_step} failed before this one"
            log.warning("%s; step %d not run", error, scheduler_output.iteration)
            return StepResult(scheduler_output.iteration, error=error)
        try:
            # On the loop's thread, not handed to one: there the forward pass and the loop (NATS, Ray's actor
            # machinery) fought over the GIL at every torch call (a one-token decode of the tiny Llama took
            # 5.1-5.5 ms against 3.9 inline; single-stream TTFT 33-37 ms against 28-32 with prefills inline
            # too). Steps run one after another anyway; a long one only delays the next step message's read.
            output = self._run(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - any failure ends the iteration with an error, not a hang
            log.error("rank %d: step %d failed:\n%s", self.rank.rank, scheduler_output.iteration,
                      traceback.format_exc())
            self.failed_step = scheduler_output.iteration
            return StepResult(scheduler_output.iteration, error=f"rank {self.rank.rank}: {type(exc).__name__}: {exc}")
        if output is None:
            return None  # not the output rank
        return StepResult(scheduler_output.iteration, output, execute_s=time.perf_counter() - start)

    def _run(self, scheduler_output: SchedulerOutput):
        """The forward pass, where a test's injected fault strikes."""
        if self.fault_file is not None:
            inject_fault(self.fault_file)
        return self.runner.execute(scheduler_output)

    async def reset(self) -> None:
        """Drop all request state (the master failed every request after a bad step); iterations go on
        being numbered where they were."""
        self.failed_step = None
        if self.runner is not None:
            self.runner.requests.clear()

    def pid(self) -> int:
        return os.getpid()


def inject_fault(path: Path) -> None:
    """Tests only (ORCA_TEST_FAULT_FILE): a file at `path` makes this one step fail, and is removed
    (so the fault fires once): "raise" raises in the forward pass, "hang <seconds>" blocks it."""
    try:
        command = path.read_text().split()
        path.unlink()  # of several workers, only the one that removes it fails
    except FileNotFoundError:
        return
    if command[:1] == ["hang"]:
        time.sleep(float(command[1]))
        return
    raise RuntimeError(f"injected fault ({path})")
