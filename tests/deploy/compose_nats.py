"""docker-compose.yml's NATS cluster (the `nats:` image services, nats-1..3) run here as local
processes, as tests/deploy/test_compose.py runs the orca services (no Docker engine on this machine):
each server with its compose command and environment and the repository's nats-server binary, the
containers' paths and ports swapped for this machine's: the config files mounted from the
repository, a store directory for each named volume, free loopback ports for the client,
monitoring and cluster ports (the routes in ORCA_NATS_ROUTES follow them).

`ComposeNatsCluster.swap` turns the compose services' `--nats-url nats://nats-1:4222,...` into the
local servers' list."""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from services.nats_server import free_ports, kill, nats_server_binary, terminate

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CLIENT_PORT, CLUSTER_PORT, MONITOR_PORT = 4222, 6222, 8222
"""The ports inside each NATS container (deploy/nats/nats.conf, ORCA_NATS_CLUSTER_LISTEN)."""


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` / `${NAME-default}` / `${NAME}`, resolved to the defaults the file
    gives (a developer's own exports do not leak into the test)."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def environment(service: str) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in (compose()["services"][service].get("environment") or {}).items()}


def nats_services() -> list[str]:
    """The compose services that run a NATS server, in name order."""
    return sorted(name for name, s in compose()["services"].items() if str(s.get("image", "")).startswith("nats:"))


class ComposeNatsServer:
    def __init__(self, service: str, store: Path) -> None:
        self.service, self.store = service, store
        self.port, self.monitor_port, self.cluster_port = free_ports(3)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def monitor(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/{path}", timeout=2) as response:
            return yaml.safe_load(response.read())  # JSON is YAML

    def healthy(self) -> bool:
        try:
            return self.monitor("healthz").get("status") == "ok"
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        kill(self.process)

    def stop(self) -> None:
        terminate(self.process)


class ComposeNatsCluster:
    """Every compose NATS service as a local nats-server (see the module docstring)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers = {name: ComposeNatsServer(name, tmp / name) for name in nats_services()}

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers.values()]

    @property
    def url(self) -> str:
        """What the orca services get as --nats-url here: every server, no credentials."""
        return ",".join(self.urls)

    def url_for(self, user: str, password: str, service: str | None = None) -> str:
        """One server's URL (the first by default) with a user's credentials, for nats.connect."""
        server = self.servers[service or next(iter(self.servers))]
        return f"nats://{user}:{password}@127.0.0.1:{server.port}"

    def swap(self, arg: str) -> str:
        """A compose argument with each `<nats service>:4222` replaced by that server's local address."""
        for name, server in self.servers.items():
            arg = arg.replace(f"//{name}:{CLIENT_PORT}", f"//127.0.0.1:{server.port}")
        return arg

    def command(self, service: str) -> tuple[list[str], dict[str, str]]:
        """The service's compose command and environment, made to run here."""
        spec, server = compose()["services"][service], self.servers[service]
        mounts: dict[str, str] = {}
        for volume in spec.get("volumes", []):
            source, target = volume.split(":")[:2]
            mounts[target] = str(ROOT / source) if source.startswith("./") else str(self.tmp / service / source)
        args = []
        for arg in spec["command"]:
            target = next((t for t in mounts if arg == t or arg.startswith(t + "/")), None)
            args.append(arg if target is None else mounts[target] + arg[len(target):])
        # Flags beat the file's own port and http_port: the container's ports are taken here.
        args += ["-a", "127.0.0.1", "-p", str(server.port), "-m", str(server.monitor_port)]
        environ = environment(service)
        environ["ORCA_NATS_CLUSTER_LISTEN"] = f"127.0.0.1:{server.cluster_port}"
        routes = environ["ORCA_NATS_ROUTES"]
        for name, other in self.servers.items():
            routes = routes.replace(f"@{name}:{CLUSTER_PORT}", f"@127.0.0.1:{other.cluster_port}")
        environ["ORCA_NATS_ROUTES"] = routes
        base = {k: v for k, v in os.environ.items() if not k.startswith("ORCA_")}
        return [nats_server_binary(), *args], {**base, **environ}

    def start(self, timeout_s: float = 30.0) -> ComposeNatsCluster:
        for name in self.servers:
            self.start_server(name)
        deadline = time.monotonic() + timeout_s
        for name, server in self.servers.items():
            while not server.healthy():
                if server.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{name} did not come up:\n{self.log(name)}")
                time.sleep(0.05)
        return self

    def start_server(self, service: str) -> None:
        server = self.servers[service]
        server.store.mkdir(parents=True, exist_ok=True)
        command, environ = self.command(service)
        with open(self.tmp / f"{service}.log", "ab") as log:
            server.process = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)

    def log(self, service: str) -> str:
        path = self.tmp / f"{service}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    cleanup = stop  # as LocalNatsServer's (the store directories are the caller's tmp)
