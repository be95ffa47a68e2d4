"""Where `orca serve`'s processes run once it is up (a real stack: nats-server, Ray, Serve, the services):
the model worker alone on its cores, every other thread of the stack on the control plane's, and the
engine master, the tokenizer service and the gateway replica (the control plane: no model) without torch."""

import os

import pytest

from services.cpu_binding import descendants, plan_cpu_layout
from services.serve import default_worker_threads

WORKER = "ray::Worker"
NO_TORCH = ("ray::EngineMasterActor", "services.tokenizer", "services.admission", "services.jobs", "ray::ServeController",
            "ray::ProxyActor", "ray::ServeReplica:orca-gateway")


def tree(root: int) -> dict[int, str]:
    """pid -> command line of `root` and everything it started, however deep."""
    found = descendants(root) | {root}
    commands = {}
    for pid in found:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                commands[pid] = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return commands


def thread_cores(pid: int) -> set[frozenset[int]]:
    cores = set()
    for thread_id in os.listdir(f"/proc/{pid}/task"):
        try:
            cores.add(frozenset(os.sched_getaffinity(int(thread_id))))
        except OSError:
            continue
    return cores


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch_cpu" in maps.read()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_the_worker_has_its_cores_and_the_rest_of_the_stack_the_others(gateway):
    cpus = sorted(os.sched_getaffinity(0))
    layout = plan_cpu_layout(cpus, 1, default_worker_threads(len(cpus), 1))
    if layout is None:
        pytest.skip("one core: nothing is bound")
    processes = tree(gateway.process.pid)
    workers = [pid for pid, command in processes.items() if command == WORKER]
    assert len(workers) == 1, processes
    assert thread_cores(workers[0]) == {frozenset(layout.workers[0])}
    elsewhere = {command: thread_cores(pid) for pid, command in processes.items() if pid not in workers}
    assert {command: cores for command, cores in elsewhere.items() if cores != {frozenset(layout.control)}} == {}
    assert len(elsewhere) > 10, "the stack's own processes: nats-server, Ray's, Serve's, the services"


def test_only_model_processes_load_torch(gateway):
    processes = tree(gateway.process.pid)
    control = {pid: command for pid, command in processes.items() if any(name in command for name in NO_TORCH)}
    assert len(control) == len(NO_TORCH), control
    assert [command for pid, command in control.items() if maps_torch(pid)] == []
    assert [maps_torch(pid) for pid, command in processes.items() if command == WORKER] == [True]
