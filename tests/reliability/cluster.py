"""The reliability tests' NATS cluster: three local nats-servers clustered on loopback ports
(services/nats_server.LocalNatsCluster: routes between every pair, JetStream on each with its own
store), of which a test kills one (SIGKILL: a crash) and starts it again; which server each client
is on (the servers' /connz); and `orca serve` on the cluster (every service given the three URLs,
the jobs streams kept in three copies). Fixtures: `nats_cluster` (a fresh cluster per test) and
`cluster_stack` (one `orca serve` on its own cluster per module); a test module imports them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import nats
import pytest

from services.nats_server import LocalNatsCluster, LocalNatsServer
from tests.gateway.helpers import GatewayServe
from tests.reliability.conftest import DRAIN_TIMEOUT_S, HANG_TIMEOUT_S, STEP_TIMEOUT_S

SIZE = 3
SERVICE_PREFIX = "orca-"
"""Every orca process names its NATS connection orca-<what> (orca-tokenizer, orca-engine-0, ...)."""


@pytest.fixture
def nats_cluster(tmp_path) -> Iterator[LocalNatsCluster]:
    cluster = LocalNatsCluster(SIZE, tmp_path / "nats").start()
    yield cluster
    cluster.cleanup()


@dataclass
class ClusterStack:
    serve: GatewayServe
    cluster: LocalNatsCluster

    @property
    def nats_urls(self) -> list[str]:
        return self.cluster.urls

    @property
    def http_url(self) -> str:
        return self.serve.http_url


@pytest.fixture(scope="module")
def cluster_stack(demo_model, tmp_path_factory) -> Iterator[ClusterStack]:
    """`orca serve` as the shared reliability stack runs (tests/reliability/conftest.py), on a
    cluster: --nats-url with the three servers, ORCA_JETSTREAM_REPLICAS=3 (inherited by the jobs
    service)."""
    cluster = LocalNatsCluster(SIZE, tmp_path_factory.mktemp("nats-cluster")).start()
    os.environ["ORCA_JETSTREAM_REPLICAS"] = str(SIZE)
    try:
        serve = GatewayServe(["--model", demo_model, "--nats-url", cluster.url, "--max-num-seqs", "4",
                              "--kv-cache-tokens", "8192", "--worker-threads", "1",
                              "--step-timeout", str(STEP_TIMEOUT_S), "--drain-timeout", str(DRAIN_TIMEOUT_S),
                              "--hang-timeout", str(HANG_TIMEOUT_S)])
    except BaseException:
        cluster.cleanup()
        raise
    finally:
        del os.environ["ORCA_JETSTREAM_REPLICAS"]
    yield ClusterStack(serve, cluster)
    serve.stop()
    cluster.cleanup()


def connections(node: LocalNatsServer) -> list[str]:
    """The names of the clients connected to `node` (a client without a name is "")."""
    body = httpx.get(node.monitor("connz?limit=4096"), timeout=5).json()
    return [c.get("name", "") for c in body.get("connections") or []]


def service_connections(cluster: LocalNatsCluster) -> dict[str, list[str]]:
    """Per running server, the orca processes connected to it."""
    return {node.name: sorted(n for n in connections(node) if n.startswith(SERVICE_PREFIX))
            for node in cluster.nodes if node.process is not None}


def tokenizer_server(cluster: LocalNatsCluster) -> LocalNatsServer:
    """The tokenizer's server (every stream passes through the tokenizer), of several the one most
    orca processes are on. nats.py spreads a service's connection over the list at random, so what
    else shares it varies from run to run: the test reports it."""
    placed = service_connections(cluster)
    return cluster.node(max(placed, key=lambda n: ("orca-tokenizer" in placed[n], len(placed[n]))))


@dataclass
class Watched:
    """A client connection's disconnects and reconnects (monotonic times)."""

    nc: nats.NATS | None = None
    disconnected: list[float] = field(default_factory=list)
    reconnected: list[float] = field(default_factory=list)


async def connect_first(cluster: LocalNatsCluster, first: LocalNatsServer) -> Watched:
    """A client on `first` (the list in order, `first` at its head), that reconnects to the others
    forever, as the services do, and notes when it lost and regained its connection."""
    watched = Watched()

    async def on_disconnect() -> None:
        watched.disconnected.append(time.monotonic())

    async def on_reconnect() -> None:
        watched.reconnected.append(time.monotonic())

    servers = [first.url] + [u for u in cluster.urls if u != first.url]
    watched.nc = await nats.connect(servers=servers, dont_randomize=True, max_reconnect_attempts=-1,
                                    reconnect_time_wait=0.5, connect_timeout=5,
                                    disconnected_cb=on_disconnect, reconnected_cb=on_reconnect)
    return watched


def restart(cluster: LocalNatsCluster, node: LocalNatsServer, timeout_s: float = 30.0) -> float:
    """Start a killed server again (same ports, same store); seconds until it is healthy."""
    start = time.monotonic()
    node.start()
    cluster.wait_healthy(timeout_s, [node])
    return time.monotonic() - start
