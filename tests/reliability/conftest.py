"""One `orca serve` for all the reliability tests (starting one costs tens of seconds): a real
nats-server the tests kill and restart, a real local Ray, the Ray Serve gateway, one engine
replica with a short step timeout, and the test-only fault injection file (ORCA_TEST_FAULT_FILE).
The drain test stops it, so it runs last; it lives as long as tests/reliability runs (package scope)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gateway.helpers import GatewayServe
from tests.reliability.helpers import Broker

STEP_TIMEOUT_S = 3.0
"""Long enough for an iteration of the tiny model on a busy 2-core machine, short enough to test."""
HANG_TIMEOUT_S = 5.0
"""A service or engine master silent this long is killed and restarted by `orca serve`."""
DRAIN_TIMEOUT_S = 20.0
JOBS_ACK_WAIT_S = 6.0
"""A killed jobs consumer's jobs go to another this long after its last heartbeat (30 s by default)."""


LIGHT = ("test_supervision.py", "test_engine_fault.py", "test_watchdog.py", "test_jobs_consumer_crash.py")
"""Modules that put little load on the machine: they run first, while the NATS-cluster module's stack
(tests/conftest.py NATS_CLUSTER) starts and works on the other worker; the loaded ones (the broker
restart, the chaos matrix, the soak) after it is done."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The light modules first; the drain test stops the shared stack: it goes after every other test."""
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("stops_stack"):
            return 2
        return 0 if item.path.name in LIGHT else 1

    items.sort(key=rank)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_stack: stops the shared reliability stack (runs last)")


@dataclass
class Stack:
    serve: GatewayServe
    broker: Broker
    fault_file: Path

    @property
    def nats_url(self) -> str:
        return self.broker.url

    @property
    def http_url(self) -> str:
        return self.serve.http_url


@pytest.fixture(scope="package")
def stack(demo_model, tmp_path_factory) -> Stack:
    base = tmp_path_factory.mktemp("reliability")
    (base / "nats").mkdir()
    broker = Broker(base / "nats").start()
    fault_file = base / "fault"
    os.environ["ORCA_TEST_FAULT_FILE"] = str(fault_file)  # inherited by orca serve, Ray and the workers
    try:
        serve = GatewayServe(["--model", demo_model, "--nats-url", broker.url, "--max-num-seqs", "4",
                              "--kv-cache-tokens", "8192", "--worker-threads", "1",
                              "--step-timeout", str(STEP_TIMEOUT_S), "--drain-timeout", str(DRAIN_TIMEOUT_S),
                              "--hang-timeout", str(HANG_TIMEOUT_S),
                              "--jobs-ack-wait", str(JOBS_ACK_WAIT_S)])
    finally:
        del os.environ["ORCA_TEST_FAULT_FILE"]
    yield Stack(serve, broker, fault_file)
    serve.stop()
    broker.stop()
