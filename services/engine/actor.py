"""The engine master as a Ray actor: it reserves a placement group for its tp x pp workers,
starts them there as Ray actors, and runs the loop.

Launched with max_restarts (services/engine/launch.py): when its process dies Ray starts it again,
its workers (which die with their owner) are started anew in the same placement group, and the
supervisor calls `run` again."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from model.arch import check_split, eos_token_ids, load_arch_config, resolve_max_model_len
from services.bus import connect, drain_quietly
from services.engine.launch import WorkerLaunch
from services.engine.master import EngineMaster
from services.engine.placement import reserve_workers, worker_bundle
from services.engine.worker_actor import Worker
from services.engine.worker_group import RayWorkerGroup
from services.logs import setup_logging
from shared.config import EngineConfig


class EngineMasterActor:
    def __init__(self, config: EngineConfig, nats_url: str, replica: str, launch: WorkerLaunch) -> None:
        setup_logging()  # a Ray actor process: timestamps and INFO lines in its log, as every service has
        self.config, self.nats_url, self.replica = config, nats_url, replica
        self.launch = launch
        self.master: EngineMaster | None = None
        self._stop = asyncio.Event()

    async def run(self) -> None:
        model = self.config.model
        max_model_len = resolve_max_model_len(model.model, model.max_model_len)
        check_split(load_arch_config(model.model), self.config.parallel.tensor_parallel_size,
                    self.config.parallel.pipeline_parallel_size)
        world = self.config.parallel.world_size
        bundle = worker_bundle(model.device, self.launch.worker_cpus)
        what = (f"engine {self.replica} (tp={self.config.parallel.tensor_parallel_size} "
                f"pp={self.config.parallel.pipeline_parallel_size})")
        group = await asyncio.to_thread(reserve_workers, world, bundle, what=what,
                                        name=f"orca-engine-{self.replica}-workers",
                                        autoscaler_wait_s=self.launch.autoscaler_wait_s)
        workers = [await self._start_worker(group, rank, bundle, max_model_len) for rank in range(world)]
        nc = await connect(self.nats_url, f"orca-engine-{self.replica}")
        self.master = EngineMaster(self.config, self.replica, nc, RayWorkerGroup(workers),
                                   max_model_len=max_model_len,
                                   eos_token_ids=eos_token_ids(self.config.model.model),
                                   step_timeout_s=self.launch.step_timeout_s)
        await self.master.start()
        try:
            await self.master.run(self._stop)
        finally:
            await drain_quietly(nc)

    async def _start_worker(self, group: Any, rank: int, bundle: dict[str, float], max_model_len: int) -> Any:
        import ray

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name = f"orca-worker-{self.replica}-{rank}"
        await asyncio.to_thread(_kill_leftover, name)
        return ray.remote(Worker).options(
            name=name, max_restarts=-1, max_task_retries=0,
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=16,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote(self.config, self.nats_url, self.replica, max_model_len, self.launch.worker_threads, rank,
                  self.launch.cores_of(rank), self.launch.borrow_cores)

    async def stop(self) -> None:
        self._stop.set()

    async def ping(self) -> tuple[str, int]:
        """For the supervisor: answers while the event loop runs (a hung master does not), with
        this process' node and pid (to kill it quickly if it hangs later)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    async def ready(self) -> bool:
        return self.master is not None and self.master.ready

    async def kv_used_blocks(self) -> int:
        return self.master.scheduler.kv_cache.num_used_blocks if self.master else -1

    async def iteration_log(self) -> list[tuple[int, list[str], list[int]]]:
        return list(self.master.iteration_log) if self.master else []


def _kill_leftover(name: str, timeout_s: float = 10.0) -> None:
    """A worker of this master's previous life may not be reaped yet (Ray kills an owner's actors
    when it dies, a moment later): free its name and devices first."""
    import ray

    try:
        leftover = ray.get_actor(name)
    except ValueError:
        return
    ray.kill(leftover, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        time.sleep(0.1)
