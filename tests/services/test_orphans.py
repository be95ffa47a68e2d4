"""An `orca serve` killed outright (kill -9, the OOM killer) leaves nothing running: its services stop
once their supervisor is gone (`services/parent_watch.py`) and its nats-server gets SIGTERM from the
kernel (`LocalNatsServer.start(die_with_parent=True)`). Real processes: a supervisor started the way
`orca serve` starts them, the real services and a real nats-server; no Ray. And a Ctrl-C while
`orca serve` starts stops it there, Ray and all."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.services.stack import ROOT, cmdline, descendants, running

SUPERVISOR = """
import pathlib, sys, tempfile, time
from services.nats_server import LocalNatsServer
from services.serve import service_command
from services.supervise import SupervisedProcess
server = LocalNatsServer().start(die_with_parent=True)
run_dir = pathlib.Path(tempfile.mkdtemp())
extra = {"tokenizer": ["--model", sys.argv[1]], "admission": [], "jobs": []}
services = [SupervisedProcess(name, lambda more, name=name: service_command(name, server.url, *extra[name], *more),
                              run_dir / f"{name}.alive", drained_pipe=name == "tokenizer").start(time.monotonic())
            for name in extra]
while not all(s.alive_file.exists() for s in services):  # each is connected and serving
    time.sleep(0.1)
print(server.process.pid, *[s.process.pid for s in services], flush=True)
time.sleep(600)
"""


def test_a_killed_supervisor_leaves_no_service_and_no_nats_server(demo_model):
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, demo_model], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
    children = [int(pid) for pid in supervisor.stdout.readline().split()]
    assert len(children) == 4 and all(running(pid) for pid in children)
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait()
    deadline = time.monotonic() + 60  # they stop within a second; `make test` runs this at nice 19 beside a busy phase
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in children if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "still running after their supervisor was killed"


@pytest.mark.slow
def test_a_ctrl_c_while_it_starts_stops_it_without_serving_first(demo_model):
    """It used to finish starting (and print "is up") before it stopped: with a model that takes
    minutes to load, a Ctrl-C did nothing for minutes."""
    serve = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", demo_model, "--port", "0"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    lines = []
    for line in serve.stdout:
        lines.append(line)
        if "waiting for engines" in line:
            break
    started = [pid for pid, _ in descendants(serve.pid)]
    serve.send_signal(signal.SIGINT)
    began = time.monotonic()
    try:
        lines += serve.stdout.readlines()
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    assert time.monotonic() - began < 20, "".join(lines)
    assert any("stopped while starting" in line for line in lines), "".join(lines)
    assert not any("is up" in line for line in lines), "".join(lines)
    deadline = time.monotonic() + 5
    while (left := [pid for pid in started if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [cmdline(pid) for pid in left]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_nats_url_nobody_answers_at_is_one_line_after_the_startup_timeout_and_leaves_nothing(demo_model):
    """It waited for ever (past --startup-timeout, deaf to Ctrl-C and SIGTERM), its services printing a
    connection error four times a second each."""
    url = f"nats://127.0.0.1:{free_port()}"
    serve = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", demo_model, "--port", "0",
                              "--nats-url", url, "--startup-timeout", "5"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    began = time.monotonic()
    try:
        out, _ = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    assert serve.returncode == 2, out
    assert f"orca: error: NATS at {url} did not answer within 5 s (--startup-timeout)" in out, out
    # once per process (the probe, jobs, admission, tokenizer, the engine master), not per attempt
    assert "Traceback" not in out and out.count("NATS error") <= 5, out
    assert time.monotonic() - began < 60, out
    deadline = time.monotonic() + 30  # Ray's processes exit a moment after orca serve; `make test` is loaded
    while (left := started_by(serve.pid, url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [cmdline(pid) for pid in left]


def started_by(session: int, url: str) -> list[int]:
    """Processes still running of `orca serve`'s session (it led one), or its services (each leads its own)
    given its NATS URL."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and running(int(entry)):
            try:
                in_session = os.getsid(int(entry)) == session
            except OSError:
                continue
            if in_session or url in cmdline(int(entry)):
                found.append(int(entry))
    return found


def test_a_service_stopped_while_nats_does_not_answer_stops_at_once():
    import asyncio

    from services.bus import run_service
    from services.serve import _connect_until

    async def go():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        began = time.monotonic()
        await asyncio.wait_for(run_service("test", f"nats://127.0.0.1:{free_port()}", start=None, stop=stop), 10)
        service_s = time.monotonic() - began
        began = time.monotonic()
        nc = await _connect_until(f"nats://127.0.0.1:{free_port()}", time.monotonic() + 30, 30,
                                  stopping=lambda: time.monotonic() - began > 0.3)
        return service_s, time.monotonic() - began, nc

    service_s, probe_s, nc = asyncio.run(go())
    assert service_s < 2 and probe_s < 2 and nc is None


def test_abandoning_a_connect_that_swallows_a_cancellation_still_ends():
    """Python 3.11's wait_for, inside nats.py's connect, turns a cancellation that lands as a refused attempt
    ends into that refusal, and nats.py retries: a single cancel then a wait hung a stopping service."""
    import asyncio

    from services.bus import abandon_connect

    async def go():
        swallowed = 0

        async def connect_retrying_for_ever():
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if swallowed == 2:
                        raise
                    swallowed += 1  # as a refused attempt's error, and nats.py tries again

        task = asyncio.ensure_future(connect_retrying_for_ever())
        await asyncio.sleep(0)
        await asyncio.wait_for(abandon_connect(task), 5)
        return swallowed, task.cancelled()

    assert asyncio.run(go()) == (2, True)
