"""Where `orca serve`'s processes run once it is up (a real stack: nats-server, Ray, Serve, the services):
the model worker on its cores (and, for an iteration that decodes nothing, on the control plane's too),
every other thread of the stack on the control plane's cores, and the
engine master, the tokenizer service and the gateway replica (the control plane: no model) without torch."""

import os

import httpx
import pytest

from model.runner import SMALL_STEP_TOKENS
from services.cpu_binding import descendants, plan_cpu_layout
from services.serve import default_worker_threads
from tests.gateway.conftest import MODEL_NAME

pytestmark = pytest.mark.slow  # on the gateway tests' stack

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
    own, control = frozenset(layout.workers[0]), frozenset(layout.control)
    # a prompt to an idle engine: its prefill decodes nothing, so the worker borrows the control cores
    response = httpx.post(f"{gateway.http_url}/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": "one two three four " * 40, "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] >= SMALL_STEP_TOKENS
    processes = tree(gateway.process.pid)
    workers = [pid for pid, command in processes.items() if command == WORKER]
    assert len(workers) == 1, processes
    worker_threads = thread_cores(workers[0])
    assert os.sched_getaffinity(workers[0]) <= own, "the worker's main thread runs on its own cores"
    borrowing = {cores for cores in worker_threads if not cores <= own}
    # OpenMP put the borrowing team's extra threads one on each control core
    assert borrowing == {frozenset([core]) for core in control}, worker_threads
    elsewhere = {command: thread_cores(pid) for pid, command in processes.items() if pid not in workers}
    assert {command: cores for command, cores in elsewhere.items() if cores != {control}} == {}
    assert len(elsewhere) > 10, "the stack's own processes: nats-server, Ray's, Serve's, the services"


def test_only_model_processes_load_torch(gateway):
    processes = tree(gateway.process.pid)
    control = {pid: command for pid, command in processes.items() if any(name in command for name in NO_TORCH)}
    assert len(control) == len(NO_TORCH), control
    assert [command for pid, command in control.items() if maps_torch(pid)] == []
    assert [maps_torch(pid) for pid, command in processes.items() if command == WORKER] == [True]
