"""docker-compose.yml: valid against the compose spec, and the stack it describes works when each
service's command and environment run here as local processes (no Docker engine on this machine)
against a local nats-server with the compose stack's own config (deploy/nats/nats.conf: a user per
service): each service starts and answers, and a producer with the `client` user gets generations
over NATS, a durable job, and a completion over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import nats
import pytest
import yaml

from services.nats_server import free_port
from tests.deploy.compose_nats import ComposeNatsCluster
from shared import subjects
from shared.codec import Codec
from shared.messages import AdmissionStatus, EngineStatus

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
STACK = ("engine", "tokenizer", "admission", "jobs", "gateway")
pytestmark = pytest.mark.slow


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` / `${NAME-default}` / `${NAME}`, resolved to the defaults the
    file gives (a developer's own exports do not leak into the test)."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def compose_environment(service: str) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in (compose()["services"][service].get("environment") or {}).items()}


def test_compose_file_is_valid_against_the_compose_spec():
    tool = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_mounts_the_files_it_names():
    """Every bind mount's source exists in the repository (observability files come from their own
    issue: a missing one is reported, with the rest checked)."""
    missing = []
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and not (ROOT / source).exists():
                missing.append(f"{name}: {source}")
    own = [m for m in missing if "deploy/observability" not in m]
    assert not own, own
    if missing:
        pytest.skip(f"not in the tree yet: {missing}")


def observability_file(relative: str) -> dict:
    path = ROOT / "deploy" / "observability" / relative
    if not path.is_file():
        pytest.skip(f"{path.relative_to(ROOT)} is not in the tree yet")
    return yaml.safe_load(path.read_text())


def mount_target(service: str, source: str) -> str:
    for volume in compose()["services"][service]["volumes"]:
        parts = volume.split(":")
        if parts[0] == source:
            return parts[1]
    raise AssertionError(f"{service} does not mount {source}")


def test_grafana_provisioning_reads_the_dashboards_where_compose_mounts_them():
    providers = observability_file("grafana/provisioning/dashboards/orca.yml")["providers"]
    target = mount_target("grafana", "./deploy/observability/grafana/dashboards")
    assert any(p["options"]["path"].rstrip("/") == target for p in providers), (providers, target)


def test_prometheus_scrapes_the_gateway_of_the_stack():
    config = observability_file("prometheus.yml")
    targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    port = compose()["services"]["gateway"]["command"][-1]
    assert f"gateway:{port}" in targets, targets
    for rule_file in config.get("rule_files", []):
        assert str(Path("/etc/prometheus") / rule_file) == mount_target("prometheus", "./deploy/observability/alerts.yml")


def test_otel_collector_takes_what_the_services_send_and_reaches_jaeger():
    config = observability_file("otel-collector.yaml")
    endpoint = compose_environment("engine")["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint.endswith(":4317") and "grpc" in config["receivers"]["otlp"]["protocols"]  # OTLP/gRPC exporter
    exporters = yaml.safe_dump(config["exporters"])
    assert "jaeger:" in exporters, exporters


def test_every_service_connects_as_its_own_nats_user():
    """Each service's ORCA_NATS_USER is a user of deploy/nats/nats.conf, and its password is the one
    the NATS container gets for that user."""
    conf = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    nats_env = compose_environment("nats-1")
    users = {}
    for name in (*STACK, "engine-gpu"):
        env = compose_environment(name)
        user = env["ORCA_NATS_USER"]
        assert f"user: {user}\n" in conf, (name, user)
        assert env["ORCA_NATS_PASSWORD"] == nats_env[f"ORCA_NATS_{user.upper()}_PASSWORD"], name
        users[name] = user
    assert len({users[n] for n in STACK}) == len(STACK)  # no two roles share a user


def local(service: str, cluster: ComposeNatsCluster | None, model_dir: str, spans: Path, http_port: int | None = None
          ) -> tuple[list[str], dict[str, str]]:
    """The compose service's command and environment, with the compose network's names swapped
    for this machine's (and spans written to a file: there is no collector here)."""
    def swap(arg: str) -> str:
        arg = cluster.swap(arg) if cluster is not None else arg
        return arg.replace("/models/demo-llama-tiny", model_dir)

    command = [swap(a) for a in compose()["services"][service]["command"]]
    if http_port is not None:
        command[command.index("--port") + 1] = str(http_port)
        command[command.index("--host") + 1] = "127.0.0.1"
    if command[0] == "python":
        command[0] = sys.executable
    elif command[0] == "orca":
        command = [sys.executable, "-m", "services.cli", *command[1:]]
    environ = {k: swap(v) for k, v in compose_environment(service).items()}
    environ["ORCA_CACHE_DIR"] = str(Path(model_dir).parent)
    if environ.get("ORCA_TRACES_EXPORTER") == "otlp":
        environ["ORCA_TRACES_EXPORTER"] = f"jsonl:{spans}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ORCA_", "OTEL_"))}
    return command, {**base, **environ}


class Running:
    def __init__(self, command: list[str], environ: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def terminate(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def output(self) -> str:
        return self.log.read_text()[-3000:]


class Stack:
    def __init__(self, server: ComposeNatsCluster, http_port: int, running: dict[str, Running]) -> None:
        self.server, self.http_port, self.running = server, http_port, running
        self.passwords = compose_environment("nats-1")

    def url(self, user: str) -> str:
        return self.server.url_for(user, self.passwords[f"ORCA_NATS_{user.upper()}_PASSWORD"])

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{r.output()}" for name, r in self.running.items())


@pytest.fixture(scope="module")
def stack(demo_model, tmp_path_factory):
    """All the compose services but `model` (the demo_model fixture made the checkpoint), started
    at once, as compose starts them."""
    tmp = tmp_path_factory.mktemp("compose")
    server = ComposeNatsCluster(tmp / "nats").start()
    http_port = free_port()
    running: dict[str, Running] = {}
    try:
        for name in STACK:
            command, environ = local(name, server, demo_model, tmp / "spans.jsonl",
                                     http_port if name == "gateway" else None)
            running[name] = Running(command, environ, tmp / f"{name}.log")
        yield Stack(server, http_port, running)
    finally:
        for r in running.values():  # all at once, then wait for each
            r.terminate()
        for r in running.values():
            r.stop()
        server.stop()


def test_model_service_makes_the_checkpoint_the_others_read(tmp_path):
    command, environ = local("model", None, str(tmp_path / "demo"), tmp_path / "spans.jsonl")
    result = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo" / "config.json").is_file() and (tmp_path / "demo" / "tokenizer.json").is_file()


def engine_ready(stack: Stack) -> EngineStatus:
    async def ready() -> EngineStatus:
        nc = await nats.connect(stack.url("gateway"))  # a user that reads engine status
        codec = Codec(EngineStatus)
        try:
            sub = await nc.subscribe(subjects.ENGINE_STATUS)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    status = codec.decode((await sub.next_msg(timeout=5)).data)
                except nats.errors.TimeoutError:
                    assert stack.running["engine"].process.poll() is None, stack.logs()
                    continue
                if status.ready:
                    return status
        finally:
            await nc.close()
        raise AssertionError("engine never reported ready:\n" + stack.logs())
    return asyncio.run(ready())


def gateway_models(stack: Stack) -> dict:
    for _ in range(480):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/v1/models", timeout=2) as response:
                return json.loads(response.read())
        except OSError:
            assert stack.running["gateway"].process.poll() is None, stack.logs()
            time.sleep(0.5)
    raise AssertionError("gateway never answered:\n" + stack.logs())


def test_engine_service_comes_up_ready(stack):
    status = engine_ready(stack)
    assert status.replica == "cpu0" and status.kv_used_blocks == 0 and status.max_model_len == 1024


def tokenizer_answer(stack: Stack) -> dict:
    """The tokenizer's answer to a request without an id, asked until it listens."""
    async def probe() -> dict:
        nc = await nats.connect(stack.url("client"))
        try:
            for _ in range(240):
                try:
                    return json.loads((await nc.request(subjects.GENERATE, b"{}", timeout=1)).data)
                except nats.errors.Error:  # still starting (no responders, or a timeout)
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()
        raise AssertionError("tokenizer never answered:\n" + stack.logs())
    return asyncio.run(probe())


def admission_status(stack: Stack) -> AdmissionStatus:
    """Admission's next status (it sends one every second once it listens)."""
    async def first_status() -> bytes:
        nc = await nats.connect(stack.url("gateway"))
        try:
            sub = await nc.subscribe(subjects.ADMISSION_STATUS)
            return (await sub.next_msg(timeout=120)).data
        finally:
            await nc.close()
    return Codec(AdmissionStatus).decode(asyncio.run(first_status()))


def test_tokenizer_service_answers(stack):
    reply = tokenizer_answer(stack)
    assert reply["finish_reason"] == "error" and "id" in reply["error"]


def test_admission_service_reports_its_queue(stack):
    assert admission_status(stack).max_queue_len > 0


def test_jobs_service_creates_its_streams(stack):
    async def streams() -> list[str]:
        nc = await nats.connect(stack.url("jobs"), inbox_prefix="_INBOX_jobs")
        js = nc.jetstream()
        try:
            for _ in range(240):
                names = [s.config.name for s in await js.streams_info()]
                if subjects.JOBS_STREAM in names and subjects.JOBS_RESULTS_STREAM in names:
                    return names
                await asyncio.sleep(0.5)
        finally:
            await nc.close()
        return []
    assert subjects.JOBS_STREAM in asyncio.run(streams()), stack.logs()


def test_gateway_service_answers_http(stack):
    body = gateway_models(stack)
    assert body["object"] == "list" and body["data"]


def test_producer_with_the_client_user_gets_a_generation_a_job_and_a_completion(stack):
    """The README's producer examples, against the stack, with the client user's credentials: one
    request and one job, each sent once on a fresh connection (once every service listens)."""
    engine_ready(stack)
    tokenizer_answer(stack)
    admission_status(stack)
    gateway_models(stack)

    async def over_nats() -> tuple[dict, dict]:
        nc = await nats.connect(stack.url("client"))
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)  # sent before the request, on its connection: in place first
            await nc.publish(subjects.GENERATE, json.dumps(
                {"id": "r1", "prompt": "def main():", "max_tokens": 8, "temperature": 0}).encode(), reply=inbox)
            event = json.loads((await sub.next_msg(timeout=120)).data)
            while event["finish_reason"] is None:
                assert event["id"] == "r1", event
                event = json.loads((await sub.next_msg(timeout=120)).data)
            js = nc.jetstream()
            job_id = f"job-{uuid.uuid4().hex[:8]}"
            job = json.dumps({"id": job_id, "prompt": "import os", "max_tokens": 4, "temperature": 0}).encode()
            await js.publish(subjects.JOBS_SUBMIT, job, headers={"Nats-Msg-Id": job_id}, timeout=30)
            for _ in range(240):
                try:
                    result = await js.get_last_msg(subjects.JOBS_RESULTS_STREAM, subjects.jobs_result(job_id))
                    return event, json.loads(result.data)
                except nats.js.errors.NotFoundError:
                    await asyncio.sleep(0.5)
            raise AssertionError("no job result:\n" + stack.logs())
        finally:
            await nc.close()

    event, job = asyncio.run(over_nats())
    assert event["finish_reason"] in ("stop", "length") and event["usage"]["completion_tokens"] >= 1, event
    assert job["finish_reason"] in ("stop", "length") and job["token_ids"], job

    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.http_port}/v1/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": "def main():", "max_tokens": 4, "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        completion = json.loads(response.read())
    assert completion["usage"]["completion_tokens"] >= 1, completion


def test_no_service_was_refused_by_nats(stack):
    """Every service's user could do all that service did (the server reports each refusal to
    the client, and services log it)."""
    engine_ready(stack)
    gateway_models(stack)
    time.sleep(2)  # a round of metric snapshots and status messages from everyone
    logs = stack.logs()
    assert "permissions violation" not in logs.lower(), logs
    assert "authorization violation" not in logs.lower(), logs


@pytest.mark.parametrize("dockerfile", ["deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint(dockerfile):
    tool = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([tool, str(ROOT / dockerfile)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


GCC_OF_RELEASE = {"bookworm": "12", "trixie": "14", "ubuntu22.04": "11", "ubuntu24.04": "13"}
"""The gcc major version of each base image's distribution release: what an apt pin `gcc=4:<major>.*` needs."""


@pytest.mark.parametrize("dockerfile", ["deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cuda"])
def test_the_apt_pins_name_the_base_images_own_release(dockerfile):
    """hadolint checks that packages are pinned, not that the pins exist: `python:3.11-slim` moved from
    bookworm to trixie, and `gcc=4:12.*` stopped resolving. The base names its release, the pin matches it,
    and an image with Triton (CUDA) has the compiler and Python headers Triton builds its launcher with."""
    text = (ROOT / dockerfile).read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    [release] = [r for r in GCC_OF_RELEASE if r in base] or [None]
    assert release is not None, f"{base}: name the distribution release, so the apt pins keep resolving"
    assert re.search(rf"\bgcc=4:{GCC_OF_RELEASE[release]}\.", text), f"{base} has gcc {GCC_OF_RELEASE[release]}"
    if "cuda" in dockerfile:
        assert "python3.12-dev=" in text and "libc6-dev=" in text


def test_the_build_context_leaves_out_what_no_image_copies():
    """.dockerignore keeps .venv (GBs after `make setup`), .git and the caches out of the context, and keeps
    in every path the Dockerfiles COPY."""
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert {".venv", ".git", ".cache"} <= set(ignored)
    for dockerfile in ("deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cuda"):
        for sources in re.findall(r"^COPY (.+) \S+$", (ROOT / dockerfile).read_text(), re.M):
            for source in sources.split():
                assert not any(source == i or source.startswith(i + "/") for i in ignored), (dockerfile, source)
                assert (ROOT / source).exists(), (dockerfile, source)


def grace_seconds(value: str) -> float:
    """A compose duration (`45s`, `1m30s`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(amount) * units[unit] for amount, unit in re.findall(r"([\d.]+)(h|m|s)", value))


@pytest.mark.parametrize("service", ["tokenizer", "jobs"])
def test_a_draining_service_gets_longer_than_its_drain_before_it_is_killed(service):
    """Docker SIGKILLs a container 10 s after its SIGTERM unless told otherwise; the tokenizer and
    jobs services drain for --drain-timeout first (requests in flight finish, or end with an error)."""
    from shared.config import ServeConfig

    drain = ServeConfig().drain_timeout
    assert grace_seconds(compose()["services"][service].get("stop_grace_period", "10s")) > drain + 5
    k8s = [doc for path in sorted((ROOT / "deploy/k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
           if doc and doc.get("kind") == "Deployment" and doc["metadata"]["name"].endswith(service)]
    assert k8s, f"no Kubernetes Deployment for {service}"
    assert all(doc["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30) > drain + 5 for doc in k8s)
