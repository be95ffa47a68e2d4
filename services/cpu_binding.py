"""Which cores the model workers and the control plane run on, on a CPU-only `orca serve`.

Each worker gets cores of its own (the last ones), and the control plane (nats-server, Ray, the
gateway, tokenizer, admission, jobs and the engine masters) the rest: a worker's thread is then never
preempted by the control plane, and the control plane never waits behind a worker's OpenMP team.
vLLM's CPU build binds its OpenMP threads the same way and leaves a core to its API server.
Measured on the 2-core VM (tiny Llama, rate inf, two runs each): `vllm bench serve` gave 2,056 and 2,011
out tok/s unbound against 2,258 and 2,342 bound; `orca bench --transport http`, with the load generator on
the control plane's core, 2,433 and 2,669 against 2,784 and 2,962.

A lone worker also borrows the control plane's cores for an iteration that decodes nothing (a prompt
arriving at an idle engine): no token streams out during it, so the control plane only waits for it.
Its extra OpenMP threads are placed on those cores (`place_openmp_threads`); every other iteration
stays on the worker's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

log = logging.getLogger("orca.cpu")


@dataclass(frozen=True)
class CpuLayout:
    control: tuple[int, ...]
    """The control plane's cores."""
    workers: tuple[tuple[int, ...], ...]
    """Each worker's cores, replica by replica, rank by rank."""


def available_cpus() -> list[int]:
    """The cores this process may run on (a taskset's or a container's cpuset, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def can_bind() -> bool:
    """Linux: threads can be bound (`bind_this_process`); elsewhere nothing is."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def plan_cpu_layout(cpus: Sequence[int], workers: int, threads: int) -> CpuLayout | None:
    """`threads` cores for each of `workers` workers, from the end of `cpus`, and what is left for the
    control plane; None when that leaves the control plane no core (then nothing is bound)."""
    ordered = sorted(set(cpus))
    needed = workers * threads
    if workers < 1 or threads < 1 or len(ordered) <= needed:
        return None
    spare = len(ordered) - needed
    return CpuLayout(control=tuple(ordered[:spare]),
                     workers=tuple(tuple(ordered[spare + i * threads: spare + (i + 1) * threads])
                                   for i in range(workers)))


def bind_this_process(cpus: Sequence[int]) -> bool:
    """Run every thread of this process (and whatever it starts later) on `cpus` alone. False, with
    a warning, where the OS refuses (a cpuset without those cores, say): the process then runs as before."""
    wanted = set(cpus)
    try:
        for thread_id in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(thread_id), wanted)
            except ProcessLookupError:
                pass  # a thread that ended since the listing: nothing of it left to bind
    except (OSError, ValueError) as exc:
        log.warning("could not bind this process to cores %s: %s", sorted(wanted), exc)
        return False
    return True


def place_openmp_threads(own: Sequence[int], borrowed: Sequence[int]) -> int:
    """Put OpenMP thread i on core i of `own` then `borrowed` (OMP_PLACES, OMP_PROC_BIND=close), so
    that a team larger than `own` runs its extra threads on the borrowed cores, one each, and a team
    within `own` never leaves it. Returns how many threads can be borrowed: len(borrowed), or 0 where
    it is too late (torch, and with it OpenMP, already loaded in this process: its places are fixed).

    Call it before `bind_this_process(own)`: OpenMP drops a place outside the cores the process may
    run on when it loads."""
    import sys

    if not borrowed:
        return 0
    if "torch" in sys.modules:
        log.warning("OpenMP is loaded already: this worker keeps to its own cores %s", list(own))
        return 0
    places = {"OMP_PLACES": ",".join(f"{{{core}}}" for core in (*own, *borrowed)), "OMP_PROC_BIND": "close"}
    os.environ.update(places)
    # A worker Ray starts again after `orca serve` bound the control plane inherits the raylet's binding,
    # the control plane's cores alone: OpenMP would drop the worker's own (libgomp "Number of places reduced").
    try:
        os.sched_setaffinity(0, {*own, *borrowed})
    except (AttributeError, OSError) as exc:
        log.warning("could not widen this process to cores %s before loading OpenMP: %s",
                    sorted({*own, *borrowed}), exc)
    import torch  # noqa: F401 - loads OpenMP now, while every place is still one this process may use

    for name in places:  # read once, at load; a child bound to fewer cores (Inductor's compile workers) would warn
        del os.environ[name]
    return len(borrowed)


def bind_process_tree(root: int, cpus: Sequence[int], workers_cores: Collection[int]) -> int:
    """Bind every thread of `root` and of all its descendants to `cpus`, but for threads already bound
    to worker cores alone (a model worker binds itself as it starts); returns how many threads moved.

    `orca serve` binds its control plane this way once the stack is up rather than before starting it:
    start-up (Ray, the actors' and services' imports, Serve) is most of a minute of CPU that would
    otherwise queue on the control plane's core while the workers' cores sit idle. New processes and
    threads inherit the binding of the thread that starts them, so what starts later stays bound too."""
    wanted, theirs = set(cpus), set(workers_cores)
    moved = 0
    for _ in range(2):  # a second pass catches a process forked by one the first pass had not bound yet
        for pid in descendants(root) | {root}:
            moved += _bind_threads(pid, wanted, theirs)
    return moved


def descendants(root: int) -> set[int]:
    """The processes `root` started, and those they started, however deep."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _bind_threads(pid: int, wanted: set[int], workers_cores: set[int]) -> int:
    moved = 0
    try:
        thread_ids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for thread_id in thread_ids:
        try:
            current = os.sched_getaffinity(int(thread_id))
            if current != wanted and not current <= workers_cores:
                os.sched_setaffinity(int(thread_id), wanted)
                moved += 1
        except OSError:
            continue  # ended meanwhile
    return moved
