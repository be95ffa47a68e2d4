"""A worker: one device's model shard, KV cache and sampler, driven by step messages.

Ray owns its lifecycle (it restarts one that dies); the engine master drives it with one
step message per iteration on NATS and gets one result message back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

from core.batch import SchedulerOutput, StepResult
from shared import subjects
from shared.codec import Codec
from shared.config import EngineConfig

log = logging.getLogger("orca.worker")
step_codec = Codec(SchedulerOutput)


class Worker:
    def __init__(self, config: EngineConfig, nats_url: str, replica: str, max_model_len: int,
                 num_threads: int | None = None) -> None:
        self.config, self.nats_url, self.replica = config, nats_url, replica
        self.max_model_len = max_model_len
        self.num_threads = num_threads
        self.runner = None
        self._subscribed = asyncio.Event()
        self._steps: asyncio.Queue = asyncio.Queue()

    async def load(self) -> None:
        if self.runner is None:
            self.runner = await asyncio.to_thread(self._build_runner)

    def _build_runner(self):
        import torch

        from model.runner import ModelRunner

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        m, c = self.config.model, self.config.cache
        return ModelRunner(m.model, dtype=m.dtype, device=m.device, num_blocks=c.num_blocks,
                           block_size=c.block_size, max_model_len=self.max_model_len, seed=m.seed,
                           kernel_backend=m.kernel_backend)

    async def wait_subscribed(self) -> None:
        await self._subscribed.wait()

    async def serve(self) -> None:
        """Execute step messages in order until the connection closes."""
        from services.bus import connect

        if self._subscribed.is_set():
            return  # already serving: one loop per worker
        nc = await connect(self.nats_url, f"orca-worker-{self.replica}")
        self.runner.requests.clear()  # a (re)start begins with no request state
        await nc.subscribe(subjects.engine_step(self.replica), cb=self._enqueue)
        self._subscribed.set()
        try:
            while True:
                data = await self._steps.get()
                result = await self._execute(data)
                await nc.publish(subjects.engine_result(self.replica), Codec.encode(result))
        finally:
            self._subscribed.clear()
            await nc.close()

    async def _enqueue(self, msg) -> None:
        await self._steps.put(msg.data)

    async def _execute(self, data: bytes) -> StepResult:
        scheduler_output = step_codec.decode(data)
        start = time.perf_counter()
        try:
            output = await asyncio.to_thread(self.runner.execute, scheduler_output)
        except Exception as exc:  # noqa: BLE001 - any failure ends the iteration with an error, not a hang
            log.error("step %d failed:\n%s", scheduler_output.iteration, traceback.format_exc())
            return StepResult(scheduler_output.iteration, error=f"{type(exc).__name__}: {exc}")
        return StepResult(scheduler_output.iteration, output, execute_s=time.perf_counter() - start)

    async def reset(self) -> None:
        """Drop all request state (the master failed every request after a bad step)."""
        if self.runner is not None:
            self.runner.requests.clear()

    def pid(self) -> int:
        import os

        return os.getpid()
