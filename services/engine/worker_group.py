"""The engine master's handle on its workers (Ray actors), and how it learns one died.

The master talks to workers with one NATS message per iteration; Ray owns their lifecycle.
A long-running `serve` call per worker doubles as a liveness probe: when a worker process
dies, that call fails at once, instead of the master waiting out a timeout. Several workers
(tensor/pipeline parallel) share one torch.distributed group, which does not survive the
loss of a member: after any failure they are all restarted and form a new group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from core.batch import StepResult

log = logging.getLogger("orca.engine")
RESTART_ATTEMPTS = 10
START_TIMEOUT_S = 300.0


class WorkerDied(Exception):
    pass


class StepTimedOut(WorkerDied):
    """No result within the step timeout: a hung forward pass, or a step lost while NATS was away."""


class WorkerGroup(Protocol):
    async def start(self) -> None: ...
    async def wait(self, result: asyncio.Future[StepResult], timeout_s: float,
                   interrupt: asyncio.Future | None = None) -> StepResult | None: ...
    async def restart(self, hard: bool) -> None: ...
    async def lost_a_worker(self, grace_s: float) -> bool: ...


class RayWorkerGroup:
    """One or more worker actors; `actors` are Ray actor handles of `services.engine.worker_actor.Worker`,
    in rank order."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self._serving: list[asyncio.Future] = []
        self._pids: list[int] = []  # of the processes serving now

    async def start(self) -> None:
        self._pids = list(await asyncio.gather(*(a.pid.remote() for a in self.actors)))
        init_method = await self.actors[0].rendezvous_address.remote() if len(self.actors) > 1 else ""
        await asyncio.gather(*(a.load.remote(init_method) for a in self.actors))
        ready = [a.serve.remote() for a in self.actors]
        self._serving = [asyncio.ensure_future(_as_future(ref)) for ref in ready]
        await asyncio.gather(*(a.wait_subscribed.remote() for a in self.actors))

    async def wait(self, result: asyncio.Future[StepResult], timeout_s: float,
                   interrupt: asyncio.Future | None = None) -> StepResult | None:
        """The step's result; None if `interrupt` completed first; WorkerDied if a worker died or
        no result came within timeout_s."""
        waiting = [result, *self._serving] + ([interrupt] if interrupt is not None else [])
        done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        if interrupt is not None and interrupt in done:
            return None
        if not done:
            raise StepTimedOut(f"no step result within {timeout_s:.0f} s (hung forward pass?)")
        failed = next(iter(done))
        raise WorkerDied(f"a worker stopped: {failed.exception() or 'serve() returned'}")

    async def lost_a_worker(self, grace_s: float) -> bool:
        """Whether a worker died (waiting up to grace_s for Ray to notice). When one dies, its
        peers' collectives fail first: their step error is the symptom, the death the cause."""
        if not self._serving:
            return False
        done, _ = await asyncio.wait(self._serving, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)

    async def restart(self, hard: bool) -> None:
        """After a failed step: `hard` (a worker died or hung), or any failure of a group of
        several, waits for Ray to restart the actors (live ones are killed first); a lone worker
        whose forward pass raised just drops its request state."""
        import ray

        if not hard and len(self.actors) == 1:
            await asyncio.gather(*(a.reset.remote() for a in self.actors))
            return
        for actor, serving in zip(self.actors, self._serving):
            if not serving.done() or len(self.actors) > 1:  # the peers of a dead worker are stuck in its group
                ray.kill(actor, no_restart=False)
        for serving in self._serving:
            serving.cancel()
        for attempt in range(RESTART_ATTEMPTS):
            try:
                await self._wait_for_new_processes(START_TIMEOUT_S)
                await asyncio.wait_for(self.start(), timeout=START_TIMEOUT_S)
                return
            except Exception as exc:  # noqa: BLE001 - Ray raises several kinds while actors come back
                log.warning("workers did not come back (attempt %d: %s)", attempt + 1, exc)
                for actor in self.actors:  # a half-formed group cannot be joined again: start over
                    ray.kill(actor, no_restart=False)
        raise RuntimeError(f"workers did not come back within {RESTART_ATTEMPTS} attempts")

    async def _wait_for_new_processes(self, timeout_s: float) -> None:
        """Until every actor answers from a process other than the one it had (a killed actor may
        still answer for a moment; a restarting one refuses calls)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pids = await asyncio.gather(*(a.pid.remote() for a in self.actors))
                if not set(pids) & set(self._pids):
                    return
            except Exception:  # noqa: BLE001 - "the actor is restarting" and the like
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not restarted within {timeout_s:.0f} s")
            await asyncio.sleep(0.05)


async def _as_future(ref: Any) -> Any:
    return await ref
