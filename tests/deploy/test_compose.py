"""docker-compose.yml: valid against the compose spec, and each service's command really starts that
service when run here as a local process against a local NATS (no Docker engine on this machine)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import pytest
import yaml

from services.nats_server import LocalNatsServer, free_port
from shared import subjects
from shared.codec import Codec
from shared.messages import AdmissionStatus, EngineStatus

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
pytestmark = pytest.mark.slow


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_is_valid_against_the_compose_spec():
    tool = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def nats_server():
    server = LocalNatsServer().start()
    yield server
    server.cleanup()


def local_command(service: str, nats_url: str, model_dir: str, port: int | None = None) -> list[str]:
    """The compose service's command, with the compose network's names swapped for this machine's."""
    command = compose()["services"][service]["command"]
    out = []
    for arg in command:
        arg = arg.replace("nats://nats:4222", nats_url).replace("/models/demo-llama-tiny", model_dir)
        out.append(arg)
    if port is not None:
        out[out.index("--port") + 1] = str(port)
        out[out.index("--host") + 1] = "127.0.0.1"
    if out[0] == "python":
        out[0] = sys.executable
    elif out[0] == "orca":
        out = [sys.executable, "-m", "services.cli", *out[1:]]
    return out


class Running:
    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def output(self) -> str:
        return self.process.stdout.read() if self.process.poll() is not None else ""


async def first_message(url: str, subject: str, timeout_s: float) -> bytes:
    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe(subject)
        return (await sub.next_msg(timeout=timeout_s)).data
    finally:
        await nc.close()


def test_model_service_makes_the_checkpoint_the_others_read(tmp_path):
    command = local_command("model", "unused", str(tmp_path / "demo"))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo" / "config.json").is_file() and (tmp_path / "demo" / "tokenizer.json").is_file()


def test_tokenizer_service_answers(nats_server, demo_model):
    service = Running(local_command("tokenizer", nats_server.url, demo_model))
    try:
        async def probe() -> dict:
            nc = await nats.connect(nats_server.url)
            try:
                for _ in range(120):
                    try:
                        return json.loads((await nc.request(subjects.GENERATE, b"{}", timeout=1)).data)
                    except Exception:  # noqa: BLE001 - still starting
                        await asyncio.sleep(0.5)
            finally:
                await nc.close()
            raise AssertionError("tokenizer never answered")
        reply = asyncio.run(probe())
        assert reply["finish_reason"] == "error" and "id" in reply["error"]
    finally:
        service.stop()


def test_admission_service_reports_its_queue(nats_server):
    service = Running(local_command("admission", nats_server.url, "unused"))
    try:
        status = Codec(AdmissionStatus).decode(asyncio.run(first_message(nats_server.url, subjects.ADMISSION_STATUS, 60)))
        assert status.queue_len == 0 and status.max_queue_len > 0
    finally:
        service.stop()


def test_jobs_service_creates_its_streams(nats_server):
    service = Running(local_command("jobs", nats_server.url, "unused"))
    try:
        async def streams() -> list[str]:
            nc = await nats.connect(nats_server.url)
            js = nc.jetstream()
            try:
                for _ in range(120):
                    names = [s.config.name for s in await js.streams_info()]
                    if subjects.JOBS_STREAM in names and subjects.JOBS_RESULTS_STREAM in names:
                        return names
                    await asyncio.sleep(0.5)
            finally:
                await nc.close()
            return []
        assert subjects.JOBS_STREAM in asyncio.run(streams())
    finally:
        service.stop()


def test_engine_service_comes_up_ready(nats_server, demo_model):
    service = Running(local_command("engine", nats_server.url, demo_model))
    try:
        async def ready() -> EngineStatus:
            nc = await nats.connect(nats_server.url)
            codec = Codec(EngineStatus)
            try:
                sub = await nc.subscribe(subjects.ENGINE_STATUS)
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    status = codec.decode((await sub.next_msg(timeout=240)).data)
                    if status.ready:
                        return status
            finally:
                await nc.close()
            raise AssertionError("engine never reported ready")
        status = asyncio.run(ready())
        assert status.kv_used_blocks == 0 and status.max_model_len == 1024
    finally:
        service.stop()
    assert service.process.returncode is not None


def test_gateway_service_answers_http(nats_server, demo_model):
    port = free_port()
    service = Running(local_command("gateway", nats_server.url, demo_model, port=port))
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                    body = json.loads(response.read())
                    break
            except (OSError, socket.timeout):
                time.sleep(0.5)
        else:
            raise AssertionError("gateway never answered: " + service.output()[-2000:])
        assert body["object"] == "list" and body["data"]
    finally:
        service.stop()


@pytest.mark.parametrize("dockerfile", ["deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint(dockerfile):
    tool = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([tool, str(ROOT / dockerfile)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
