"""Launch engine master actors and keep them running: the one place that does (`orca serve` and
`python -m services.engine` both use it).

Ray restarts a master whose process dies (max_restarts) but does not call `run` on the new one:
`MasterSupervisor.check` does, after a backoff. It also pings the master through Ray: one that
answers nothing for `hang_timeout_s` is hung (a blocked loop, a SIGSTOP) and is killed for Ray to
restart. Meanwhile the rest of the system has already counted it gone from its silent heartbeat
(STATUS_EXPIRY_S) and resumes its requests once it, or another replica, serves again.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.config import EngineConfig, ServeConfig

log = logging.getLogger("orca.engine")
START_GRACE_S = 60.0
"""After a (re)start, pings may wait while Ray brings the actor up: no hang verdict until then."""
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Delay before running a master again after its n-th failure in a row (the last one repeats)."""
STABLE_S = 60.0
"""A master that ran this long since its last start begins the backoff from the first delay again."""


class WorkerLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an engine replica runs its workers; every launcher passes one (`orca serve`,
    `python -m services.engine`, the RayService builder)."""

    step_timeout_s: float = 120.0
    """An iteration with no result within this long counts as a dead worker."""
    worker_cpus: float = 1.0
    """Ray CPUs each worker reserves."""
    worker_threads: int | None = None
    """Torch threads per worker (None: torch's default)."""
    worker_cores: tuple[tuple[int, ...], ...] | None = None
    """Cores each worker (by rank) runs on alone (services/cpu_binding.py); None: not bound."""
    borrow_cores: tuple[int, ...] = ()
    """The control plane's cores a lone bound worker also runs on in an iteration that decodes nothing."""
    autoscaler_wait_s: float | None = None
    """None: devices the cluster does not have are refused at once (a fixed cluster); else how long to wait
    for an autoscaler to add nodes with them (the RayService)."""

    @classmethod
    def of(cls, settings: ServeConfig, worker_threads: int | None = None,
           worker_cores: tuple[tuple[int, ...], ...] | None = None,
           borrow_cores: tuple[int, ...] = (), autoscaler_wait_s: float | None = None) -> WorkerLaunch:
        """The workers' part of a launcher's ServeConfig; `worker_threads` where the launcher chose
        them (`orca serve` counts cores), and the cores it bound them to."""
        return cls(step_timeout_s=settings.step_timeout, worker_cpus=settings.worker_cpus,
                   worker_threads=worker_threads or settings.worker_threads, worker_cores=worker_cores,
                   borrow_cores=borrow_cores, autoscaler_wait_s=autoscaler_wait_s)

    def cores_of(self, rank: int) -> tuple[int, ...] | None:
        return self.worker_cores[rank] if self.worker_cores else None


REPLICA_SETTINGS = ("worker_threads", "worker_cpus", "step_timeout", "hang_timeout")
"""The ServeConfig fields one engine replica takes (shared/config.py)."""


def replica_parser(prog: str) -> argparse.ArgumentParser:
    """The flags of one engine replica: the engine's, and the ServeConfig fields it uses. `python -m
    services.engine` parses its command line with it, the RayService builder its `engine_args`."""
    from services.cli import add_engine_args
    from services.service_args import add_service_args
    from shared.flags import add_serve_flags

    parser = argparse.ArgumentParser(prog=prog)
    add_engine_args(parser)
    add_service_args(parser, alive_file="every half second while supervising")
    parser.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    parser.add_argument("--replica", default="0", help="this replica's name (unique per engine)")
    add_serve_flags(parser.add_argument_group("launch"), REPLICA_SETTINGS)
    return parser


def launch_master(config: EngineConfig, nats_url: str, replica: str, launch: WorkerLaunch, *,
                  restarted_by_ray: bool = True) -> Any:
    """The master actor of one engine replica (not yet running: call `run`); every launcher starts it
    here. `restarted_by_ray`: a named actor Ray restarts (`orca serve`, `python -m services.engine`);
    False for one fate-shared with a Serve replica, which Serve restarts (services/rayservice.py)."""
    import ray

    from services.engine.actor import EngineMasterActor

    lifecycle = ({"name": f"orca-engine-{replica}", "max_restarts": -1, "max_task_retries": 0}
                 if restarted_by_ray else {})
    return ray.remote(EngineMasterActor).options(num_cpus=0, max_concurrency=64, **lifecycle).remote(
        config, nats_url, replica, launch)


@dataclass
class MasterSupervisor:
    """One engine replica's master: its `run` call, kept going; `check` it a few times a second."""

    replica: str
    actor: Any
    hang_timeout_s: float = 10.0
    run_ref: Any = None
    failures: int = 0
    started_at: float = 0.0
    next_run_at: float | None = None
    ping_ref: Any = None
    ping_sent_at: float = 0.0
    process: tuple[str, int] | None = None
    """(node id, pid) of the master's process, from its last answer."""
    grace_until: float = 0.0
    events: list[str] = field(default_factory=list)

    def start(self, now: float) -> MasterSupervisor:
        self.run_ref = self.actor.run.remote()
        self.started_at, self.grace_until = now, now + START_GRACE_S
        return self

    def check(self, now: float) -> None:
        import ray

        if self.next_run_at is not None:
            if now >= self.next_run_at:
                self.next_run_at = None
                self.start(now)
            return
        if ray.wait([self.run_ref], timeout=0)[0]:
            self._ended(now)
            return
        self._watch_ping(now)

    def _ended(self, now: float) -> None:
        """`run` returned or failed: the process died (Ray restarts it) or the loop gave up (then
        the actor is killed, so the next run starts from a clean process)."""
        import ray

        why = _outcome(self.run_ref)
        if "actor is restarting" in why:  # `run` was called again before Ray had the actor back
            self.next_run_at = now + 0.5
            return
        if not why.startswith(("ActorDiedError", "ActorUnavailableError")):
            ray.kill(self.actor, no_restart=False)
        self.failures = 1 if now - self.started_at > STABLE_S else self.failures + 1
        delay = RESTART_BACKOFF_S[min(self.failures - 1, len(RESTART_BACKOFF_S) - 1)]
        self._note(f"engine master {self.replica} stopped ({why}); running it again in {delay:.0f} s")
        self.next_run_at, self.ping_ref, self.process = now + delay, None, None

    def _watch_ping(self, now: float) -> None:
        import ray

        if self.ping_ref is not None and ray.wait([self.ping_ref], timeout=0)[0]:
            self.process = _answer(self.ping_ref)  # None: an error from a restarting actor, alive either way
            self.ping_ref = None
            if self.process is not None:
                self.grace_until = 0.0  # it is up: from now on silence means a hang
        if self.ping_ref is None:
            self.ping_ref, self.ping_sent_at = self.actor.ping.remote(), now
        elif now - self.ping_sent_at > self.hang_timeout_s and now > self.grace_until:
            self._note(f"engine master {self.replica} answered nothing for {self.hang_timeout_s:.0f} s (hung); "
                       "killing it for Ray to restart")
            self._kill()
            self.ping_ref, self.grace_until = None, now + START_GRACE_S

    def _kill(self) -> None:
        """SIGKILL at once when the process is on this node (Ray's own kill first asks the process
        to exit, and waits seconds for a hung one), and tell Ray either way."""
        import ray

        if self.process is not None and self.process[0] == ray.get_runtime_context().get_node_id():
            try:
                os.kill(self.process[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.kill(self.actor, no_restart=False)
        self.process = None

    def _note(self, event: str) -> None:
        log.warning("%s", event)
        self.events.append(event)


def _answer(ref: Any) -> tuple[str, int] | None:
    import ray

    try:
        return tuple(ray.get(ref, timeout=5))
    except Exception:  # noqa: BLE001 - a restarting actor: no process to note
        return None


def _outcome(ref: Any) -> str:
    import ray

    try:
        ray.get(ref, timeout=5)
    except Exception as exc:  # noqa: BLE001 - whatever ended it is reported, not raised
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return "returned"
