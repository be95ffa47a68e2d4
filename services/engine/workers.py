"""The engine master's handle on its workers (Ray actors), and how it learns one died.

The master talks to workers with one NATS message per iteration; Ray owns their lifecycle.
A long-running `serve` call per worker doubles as a liveness probe: when a worker process
dies, that call fails at once, instead of the master waiting out a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from core.batch import StepResult

log = logging.getLogger("orca.engine")


class WorkerDied(Exception):
    pass


class WorkerGroup(Protocol):
    async def start(self) -> None: ...
    async def wait(self, result: asyncio.Future[StepResult], timeout_s: float) -> StepResult: ...
    async def restart(self, hard: bool) -> None: ...


class RayWorkerGroup:
    """One or more worker actors; `actors` are Ray actor handles of `services.engine.worker.Worker`."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self._serving: list[asyncio.Future] = []

    async def start(self) -> None:
        await asyncio.gather(*(a.load.remote() for a in self.actors))
        ready = [a.serve.remote() for a in self.actors]
        self._serving = [asyncio.ensure_future(_as_future(ref)) for ref in ready]
        await asyncio.gather(*(a.wait_subscribed.remote() for a in self.actors))

    async def wait(self, result: asyncio.Future[StepResult], timeout_s: float) -> StepResult:
        done, _ = await asyncio.wait([result, *self._serving], timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        if not done:
            raise WorkerDied(f"no step result within {timeout_s:.0f} s (hung forward pass?)")
        failed = next(iter(done))
        raise WorkerDied(f"a worker stopped: {failed.exception() or 'serve() returned'}")

    async def restart(self, hard: bool) -> None:
        """After a failed step: `hard` (a worker died or hung) waits for Ray to restart the
        actor (a hung one is killed first); otherwise the live workers drop request state."""
        import ray

        if not hard:
            await asyncio.gather(*(a.reset.remote() for a in self.actors))
            return
        for actor, serving in zip(self.actors, self._serving):
            if not serving.done():
                ray.kill(actor, no_restart=False)
        for serving in self._serving:
            serving.cancel()
        for _ in range(120):
            try:
                await self.start()
                return
            except Exception as exc:  # noqa: BLE001 - Ray raises several kinds while the actor comes back
                log.warning("waiting for workers to come back (%s)", exc)
                await asyncio.sleep(1.0)
        raise RuntimeError("workers did not come back within 120 attempts")


async def _as_future(ref: Any) -> Any:
    return await ref
