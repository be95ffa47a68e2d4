"""The engine master as a Ray actor: it starts its workers as Ray actors and runs the loop."""

from __future__ import annotations

import asyncio

from model.arch import eos_token_ids, resolve_max_model_len
from services.bus import connect, drain_quietly
from services.engine.master import EngineMaster
from services.engine.worker import Worker
from services.engine.workers import RayWorkerGroup
from shared.config import EngineConfig


class EngineMasterActor:
    def __init__(self, config: EngineConfig, nats_url: str, replica: str, *, worker_cpus: float = 1.0,
                 worker_threads: int | None = None, step_timeout_s: float = 120.0) -> None:
        self.config, self.nats_url, self.replica = config, nats_url, replica
        self.worker_cpus, self.worker_threads = worker_cpus, worker_threads
        self.step_timeout_s = step_timeout_s
        self.master: EngineMaster | None = None
        self._stop = asyncio.Event()

    async def run(self) -> None:
        import ray

        max_model_len = resolve_max_model_len(self.config.model.model, self.config.model.max_model_len)
        worker = ray.remote(Worker).options(
            name=f"orca-worker-{self.replica}-0", max_restarts=-1, max_task_retries=0,
            num_cpus=self.worker_cpus, max_concurrency=16,
        ).remote(self.config, self.nats_url, self.replica, max_model_len, self.worker_threads)
        nc = await connect(self.nats_url, f"orca-engine-{self.replica}")
        self.master = EngineMaster(self.config, self.replica, nc, RayWorkerGroup([worker]),
                                   max_model_len=max_model_len,
                                   eos_token_ids=eos_token_ids(self.config.model.model),
                                   step_timeout_s=self.step_timeout_s)
        await self.master.start()
        try:
            await self.master.run(self._stop)
        finally:
            await drain_quietly(nc)

    async def stop(self) -> None:
        self._stop.set()

    async def ready(self) -> bool:
        return self.master is not None and self.master.ready

    async def kv_used_blocks(self) -> int:
        return self.master.scheduler.kv_cache.num_used_blocks if self.master else -1

    async def iteration_log(self) -> list[tuple[int, list[str]]]:
        return self.master.iteration_log if self.master else []
