"""Supervision on real processes, in seconds: `orca serve`'s SupervisedProcess restarts a service
that exits and kills (then restarts) one that hangs; a real service's liveness file goes stale when
it is SIGSTOPped, so the probe that compose and Kubernetes run fails; and those deployments probe
the very file each service's command touches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from services.nats_server import LocalNatsServer
from services.supervise import SupervisedProcess, stop_processes
from tests.services.stack import ROOT

SERVICE = """
import sys, time, pathlib
alive = pathlib.Path(sys.argv[sys.argv.index("--alive-file") + 1])
while True:
    alive.touch()
    time.sleep(0.1)
"""


def probe(path: Path, max_age_s: float) -> int:
    return subprocess.run([sys.executable, "-m", "services.liveness", str(path), str(max_age_s)], cwd=ROOT,
                          capture_output=True, timeout=30).returncode


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_service_that_exits_is_restarted_and_one_that_hangs_is_killed_and_restarted(tmp_path):
    service = SupervisedProcess("fake", lambda extra: [sys.executable, "-c", SERVICE, *extra], tmp_path / "fake.alive",
                                hang_timeout_s=1.0).start(time.monotonic())
    try:
        wait_until(lambda: service.alive_file.exists(), 20, "the service never touched its file")
        first = service.process.pid
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: (service.check(time.monotonic(), time.time()), service.process.pid != first)[1], 20,
                   "not restarted after it exited")
        second = service.process.pid
        wait_until(lambda: service.alive_file.exists(), 20, "the restarted service never touched its file")
        os.kill(second, signal.SIGSTOP)  # hung: alive, silent
        stopped_at = time.monotonic()
        wait_until(lambda: (service.check(time.monotonic(), time.time()), service.process.pid != second)[1], 20,
                   "a hung service was not replaced")
        replaced_in = time.monotonic() - stopped_at
    finally:
        stop_processes([service])
    assert any("exited with -9" in e for e in service.events), service.events
    assert any("is hung" in e for e in service.events), service.events
    assert 1.0 < replaced_in < 10.0, replaced_in


def test_a_real_service_fails_its_liveness_probe_while_sigstopped_and_passes_again_when_it_runs(tmp_path):
    server = LocalNatsServer().start()
    alive = tmp_path / "admission.alive"
    process = subprocess.Popen([sys.executable, "-m", "services.admission", "--nats-url", server.url,
                                "--alive-file", str(alive)], cwd=ROOT, start_new_session=True)
    try:
        wait_until(alive.exists, 60, "admission never touched its liveness file")
        assert probe(alive, 3) == 0
        process.send_signal(signal.SIGSTOP)
        time.sleep(4.0)
        assert probe(alive, 3) == 1, "a hung service passed its liveness probe"
        process.send_signal(signal.SIGCONT)
        wait_until(lambda: probe(alive, 3) == 0, 20, "the probe did not pass once the service ran again")
    finally:
        process.kill()
        process.wait(timeout=10)
        server.cleanup()
    assert probe(tmp_path / "absent", 3) == 1


def test_compose_and_kubernetes_probe_the_file_each_service_touches():
    compose = yaml.safe_load((Path(ROOT) / "docker-compose.yml").read_text())["services"]
    k8s = {d["metadata"]["name"]: d for d in yaml.safe_load_all((Path(ROOT) / "deploy/k8s/services.yaml").read_text())}
    for name in ("tokenizer", "admission", "jobs", "engine"):
        command = compose[name]["command"]
        touched = command[command.index("--alive-file") + 1]
        assert compose[name]["healthcheck"]["test"][1:4] == ["python", "-m", "services.liveness"], name
        assert compose[name]["healthcheck"]["test"][4] == touched, name
        assert compose[name]["restart"] == "unless-stopped", name
    for name in ("tokenizer", "admission", "jobs"):
        [container] = k8s[name]["spec"]["template"]["spec"]["containers"]
        touched = container["command"][container["command"].index("--alive-file") + 1]
        for probe_kind in ("livenessProbe", "startupProbe"):
            check = container[probe_kind]["exec"]["command"]
            assert check[:3] == ["python", "-m", "services.liveness"] and check[3] == touched, (name, probe_kind)
