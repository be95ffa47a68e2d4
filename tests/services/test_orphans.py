"""An `orca serve` killed outright (kill -9, the OOM killer) leaves nothing running: its services stop
once their supervisor is gone (`services/parent_watch.py`) and its nats-server gets SIGTERM from the
kernel (`LocalNatsServer.start(die_with_parent=True)`). Real processes: a supervisor started the way
`orca serve` starts them, the real services and a real nats-server; no Ray."""

import os
import signal
import subprocess
import sys
import time

from tests.services.stack import ROOT

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


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended; init reaps it
    except FileNotFoundError:
        return False


def test_a_killed_supervisor_leaves_no_service_and_no_nats_server(demo_model):
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, demo_model], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
    children = [int(pid) for pid in supervisor.stdout.readline().split()]
    assert len(children) == 4 and all(running(pid) for pid in children)
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait()
    deadline = time.monotonic() + 20
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in children if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "still running after their supervisor was killed"
