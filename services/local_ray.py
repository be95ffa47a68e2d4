"""The Ray cluster `orca serve` runs on, and what to do when a local one dies under it.

A SIGTERM to `orca serve`'s whole process group (`kill -- -PGID`), or to its cgroup (systemd stops a
unit that way by default), reaches the Ray head processes that `ray.init` started along with
`orca serve` itself. Their GCS then stops answering at once but lives on for a while. Before this
module, every Ray call of the stop (the gateway's open requests, the engine masters' stop,
`ray.shutdown`) blocked until Ray's own 60 s GCS timeout killed `orca serve` (exit 1), while Ray's
error-listener thread spun a core on the dead GCS. Now the stop skips what died with Ray and ends in
seconds."""

from __future__ import annotations

import logging
import os
import signal
import sys

RAY_SETTINGS = {
    # Ray runs actors at niceness 15 by default: the model workers would then yield the CPU to every
    # other process on the machine. They are the hot path; run them at normal priority.
    "RAY_worker_niceness": "0",
    # A killed actor's process gets this long to exit before the raylet SIGKILLs it (Ray's default 5 s).
    # Only a hung process uses it (a live one exits at once): a hung worker or engine master is killed
    # to be restarted, and every second of it is a second nothing is served. Measured on a SIGSTOPped
    # worker (step timeout 3 s): served again after 10.8 s with Ray's default, 6.5 s with this.
    "RAY_kill_worker_timeout_milliseconds": "1000",
    # A call to an actor whose process died waits this long for the GCS's word of its death before it
    # fails (Ray's default 1 s); KubeRay sets 0 on RayService clusters "to improve service SLA". Measured on
    # an idle worker's SIGKILL: the master learned of it (and /health said 503) after 0.5 s instead of 2.0.
    "RAY_timeout_ms_task_wait_for_death_info": "0",
}
"""Ray's settings for the processes of a Ray that `orca serve` or `python -m services.engine` start (the
raylet reads them from its environment); deploy/k8s/rayservice.yaml gives every Ray pod the same."""


def apply_ray_settings() -> None:
    """Before `ray.init`: RAY_SETTINGS, unless the environment sets them already."""
    for name, value in RAY_SETTINGS.items():
        os.environ.setdefault(name, value)


GCS_PROBE_TIMEOUT_S = 2.0
"""A local GCS answers the probe in about a millisecond; one that is stopping never does."""


class RayCluster:
    """The Ray this process has initialised: `owned` when `orca serve` started it (no --ray-address)."""

    def __init__(self, owned: bool) -> None:
        self.owned = owned
        self.gone = False

    def check_gone(self) -> bool:
        """At the stop: whether an owned cluster is gone or going (its head exited, or its GCS does not
        answer). If so, stop the driver's Ray threads from spinning on it and kill what is left of its
        processes, so that the rest of the stop runs on idle cores. Not while serving: on a machine
        busy enough, a healthy GCS could miss the probe's deadline."""
        if not self.owned or self.gone:
            return self.gone
        self.gone = _head_exited() or not _gcs_answers(GCS_PROBE_TIMEOUT_S)
        if self.gone:
            print("orca-serve: the local Ray cluster is stopping or gone (did the whole process group get the "
                  "signal?): skipping what died with it", file=sys.stderr, flush=True)
            _silence_driver_threads()
            _kill_with_descendants([info.process.pid for info in _node_processes() if info.process.poll() is None])
        return self.gone

    def shutdown(self) -> None:
        """`ray.shutdown`, unless the cluster is gone: it then blocks for 5-15 s on the dead GCS."""
        if not self.gone:
            import ray

            ray.shutdown()

    def exit_now_if_gone(self, code: int) -> None:
        """After the stop: a gone cluster leaves Ray's exit handler (`ray.shutdown` again) and its
        threads waiting on the dead GCS; exit without them."""
        if self.gone:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(code)


def _head_exited() -> bool:
    from ray._private import ray_constants

    head = _node_processes(ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER)
    return any(info.process.poll() is not None for info in head)


def _node_processes(*kinds: str) -> list:
    """The processes `ray.init` started on this machine (of `kinds`, or all), as Ray's ProcessInfo."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    return [info for kind, infos in processes.items() if not kinds or kind in kinds for info in infos]


def _gcs_answers(timeout_s: float) -> bool:
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return True
    try:
        node.get_gcs_client().internal_kv_get(b"orca-serve-probe", b"orca", timeout=timeout_s)
    except Exception:  # noqa: BLE001 - any failure to answer is a GCS that is gone
        return False
    return True


def _silence_driver_threads() -> None:
    """Ray's error listener polls the GCS in a loop that spins when the GCS is gone (Ray 2.60); its
    stop event is the one `ray.shutdown` sets."""
    import ray

    stopped = getattr(ray._private.worker.global_worker, "threads_stopped", None)
    if stopped is not None:
        stopped.set()


def _kill_with_descendants(pids: list[int]) -> None:
    """SIGKILL these processes and everything they started (the raylet's workers: the engine masters,
    model workers and Serve actors would otherwise notice its death some seconds later)."""
    from services.cpu_binding import descendants

    victims = {pid for root in pids for pid in (root, *descendants(root))} if os.path.isdir("/proc") else set(pids)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
