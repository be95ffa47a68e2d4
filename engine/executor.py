"""How the in-process engine runs its iterations: one runner in this process, or tensor x
pipeline parallel worker processes on this machine.

Both take step messages in order (`submit`) and give back the output rank's results in the
same order (`collect`), so the engine can keep several iterations in flight: one per
pipeline stage. The worker processes form a torch.distributed group (gloo on CPU, NCCL on
CUDA) for the tensors; steps and results travel as the same msgspec bytes the services send
over NATS, through pipes. `orca serve` runs the same workers as Ray actors instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from core.batch import RunnerOutput, SchedulerOutput
from shared.parallel import ParallelRank
from shared.codec import Codec
from shared.config import EngineConfig

step_codec, output_codec = Codec(SchedulerOutput), Codec(RunnerOutput)


class Executor(Protocol):
    depth: int
    """Iterations it can hold in flight (the number of pipeline stages)."""

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...
    def collect(self) -> RunnerOutput: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class RunnerArgs:
    """What a worker needs to build its runner (picklable): the engine's config, read there, and what
    the engine resolved from it."""

    config: EngineConfig
    max_model_len: int
    """The context the scheduler admits for (the model's own unless the config caps it)."""
    borrowed_threads: int = 0
    """Threads a lone CPU worker may add on the control plane's cores (model/runner.py)."""

    def build(self, groups=None):
        from model.runner import ModelRunner

        m, c = self.config.model, self.config.cache
        return ModelRunner(m.model, dtype=m.dtype, device=m.device, num_blocks=c.num_blocks,
                           block_size=c.block_size, max_model_len=self.max_model_len, seed=m.seed,
                           kernel_backend=m.kernel_backend, groups=groups, enforce_eager=m.enforce_eager,
                           borrowed_threads=self.borrowed_threads)


class LocalExecutor:
    """One runner, in this process: each step runs as it is submitted."""

    depth = 1

    def __init__(self, runner) -> None:
        self.runner = runner
        self._done: deque[RunnerOutput] = deque()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._done.append(self.runner.execute(scheduler_output))

    def collect(self) -> RunnerOutput:
        return self._done.popleft()

    def close(self) -> None:
        pass


class WorkerFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class StageTimes:
    step_s: float
    """Wall time inside steps."""
    recv_wait_s: float
    """Of which waiting for the previous stage's activations (idle: a pipeline bubble)."""


class MultiprocExecutor:
    """tp x pp worker processes; the engine keeps up to pp iterations in flight."""

    def __init__(self, config: EngineConfig, max_model_len: int, *, startup_timeout_s: float = 300.0,
                 step_timeout_s: float = 600.0) -> None:
        parallel = config.parallel
        self.tp, self.pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.depth = self.pp
        self.step_timeout_s = step_timeout_s
        # Not fork: it would copy this process's torch thread pools and state. A fork server that
        # has imported torch and the model code once starts each worker in a fraction of a second.
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["__main__", "torch", "model.runner", "engine.executor"])
        self.results = context.Queue()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, (os.cpu_count() or 1) // (self.tp * self.pp))
        args = RunnerArgs(config, max_model_len)
        self.pipes = []
        self.processes = []
        for rank in range(self.tp * self.pp):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, name=f"orca-worker-{rank}", daemon=True,
                                      args=(rank, self.tp, self.pp, init_method, args, threads, child, self.results))
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        try:
            for _ in self.processes:
                kind, rank, detail = self._next(startup_timeout_s, "start")
                if kind != "ready":
                    raise WorkerFailed(f"worker {rank} failed to start: {detail}")
        except BaseException:
            self.close()
            raise

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        data = Codec.encode(scheduler_output)
        for pipe in self.pipes:
            pipe.send(("step", data))

    def collect(self) -> RunnerOutput:
        kind, rank, detail = self._next(self.step_timeout_s, "step")
        if kind != "result":
            raise WorkerFailed(f"worker {rank}: {detail}")
        return output_codec.decode(detail)

    def stage_times(self) -> list[StageTimes]:
        """Each worker's time in steps and waiting for the previous stage, in rank order
        (call with nothing in flight)."""
        for pipe in self.pipes:
            pipe.send(("times", b""))
        times: dict[int, StageTimes] = {}
        while len(times) < len(self.pipes):
            kind, rank, detail = self._next(60.0, "times")
            if kind != "times":
                raise WorkerFailed(f"worker {rank}: {detail}")
            times[rank] = detail
        return [times[rank] for rank in sorted(times)]

    def _next(self, timeout_s: float, what: str) -> tuple[str, int, object]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead:
                    raise WorkerFailed(f"worker process {', '.join(dead)} died during {what}") from None
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"no {what} result from the workers within {timeout_s:.0f} s") from None

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", b""))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


def _worker_main(rank: int, tp: int, pp: int, init_method: str, args: RunnerArgs, threads: int,
                 steps, results) -> None:
    import torch

    from model.distributed import destroy_distributed, init_distributed

    # A Ctrl-C reaches the whole process group: the engine process stops its workers itself
    # (each printed a KeyboardInterrupt traceback otherwise).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        groups = init_distributed(ParallelRank.of(rank, tp, pp), init_method, args.config.model.device)
        runner = args.build(groups)
    except Exception:  # noqa: BLE001 - reported to the engine, which stops
        results.put(("error", rank, traceback.format_exc()))
        return
    results.put(("ready", rank, None))
    step_s = 0.0
    try:
        while True:
            kind, data = steps.recv()
            if kind == "stop":
                break
            if kind == "times":
                results.put(("times", rank, StageTimes(step_s, groups.recv_wait_s)))
                continue
            start = time.perf_counter()
            try:
                output = runner.execute(step_codec.decode(data))
            except Exception:  # noqa: BLE001 - the engine turns it into an error for the batch
                results.put(("error", rank, traceback.format_exc()))
                continue
            finally:
                step_s += time.perf_counter() - start
            if output is not None:
                results.put(("result", rank, Codec.encode(output)))
    except EOFError:
        pass
    finally:
        destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
