"""`python -m services.gateway` (compose's gateway) stops on SIGTERM while NATS does not answer: it waited
for NATS inside its lifespan, deaf to the signal, until compose's grace period ran out and it was killed.
A checkpoint it cannot serve is one line before uvicorn starts, not uvicorn's lifespan traceback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services.stack import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_stops_a_gateway_still_waiting_for_nats(demo_model):
    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens there
    gateway = subprocess.Popen([sys.executable, "-m", "services.gateway", "--nats-url", url, "--model", demo_model,
                                "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in gateway.stdout:  # until it is waiting for NATS
            lines.append(line)
            if "NATS error" in line:
                break
        gateway.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, _ = gateway.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        if gateway.poll() is None:
            gateway.kill()
    said = "".join(lines) + out
    assert took < 15, said  # the fault is a gateway that never stops; the unit tests run at nice 19 beside stacks
    assert gateway.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM), said
    assert "stopped before NATS" in said and "Traceback" not in said, said


@pytest.mark.parametrize(("what", "says"), [("missing", "is not a directory"), ("empty", "has no tokenizer files"),
                                            ("tokenizer only", "no config.json")])
def test_a_checkpoint_the_gateway_cannot_serve_is_named(demo_model, tmp_path, what, says):
    from services.gateway.__main__ import model_problem

    model = tmp_path / "model"
    if what != "missing":
        model.mkdir()
    if what == "tokenizer only":
        (model / "tokenizer.json").write_bytes((Path(demo_model) / "tokenizer.json").read_bytes())
    assert says in model_problem(str(model))
    assert model_problem(demo_model) is None


def test_a_checkpoint_the_gateway_cannot_serve_is_one_line_and_exit_2_before_uvicorn_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.gateway", "--nats-url", f"nats://127.0.0.1:{free_port()}",
                           "--model", str(tmp_path / "missing"), "--port", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "is not a directory" in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("python -m services.gateway: error:"), done.stderr
