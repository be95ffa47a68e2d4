"""services/nats_server.py's local cluster (for tests, and for `orca serve` users who want one):
N real nats-servers on loopback ports that form one cluster with JetStream on each, a server
killed and started again keeps its store, and `python -m services.nats_server --cluster 3` prints
the server list that services take as --nats-url."""

from __future__ import annotations

import asyncio
import os
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import nats

from services.bus import connect
from services.jobs.service import ensure_streams
from services.nats_server import LocalNatsCluster
from shared import subjects
from tests.services.stack import ROOT


def monitor(node, path: str) -> dict:
    with urllib.request.urlopen(node.monitor(path), timeout=2) as response:
        return json.loads(response.read())


def test_a_local_cluster_forms_with_jetstream_on_every_server(tmp_path):
    cluster = LocalNatsCluster(3, tmp_path).start()
    try:
        names = {n.name for n in cluster.nodes}
        assert len(names) == 3 and cluster.url == ",".join(cluster.urls)
        for node in cluster.nodes:
            assert {r["remote_name"] for r in monitor(node, "routez")["routes"]} == names - {node.name}
            assert monitor(node, "jsz")["meta_cluster"]["cluster_size"] == 3
            assert (tmp_path / node.name / "jetstream").is_dir()  # a store of its own
    finally:
        cluster.cleanup()


def test_a_killed_server_comes_back_with_its_store_and_rejoins(tmp_path):
    cluster = LocalNatsCluster(3, tmp_path).start()

    async def streams(timeout_s: float) -> tuple[int, list[str]]:
        """The jobs stream's replicas and peers, once it answers (after a leader's death JetStream
        elects another first: seconds)."""
        nc = await connect(cluster.url, "test")
        deadline = time.monotonic() + timeout_s
        try:
            await ensure_streams(nc, replicas=3)
            while True:
                try:
                    info = await nc.jetstream().stream_info(subjects.JOBS_STREAM)
                    peers = [info.cluster.leader, *(p.name for p in info.cluster.replicas or [])]
                    if None not in peers or time.monotonic() > deadline:
                        return info.config.num_replicas, sorted(map(str, peers))
                except nats.errors.TimeoutError:
                    if time.monotonic() > deadline:
                        raise
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    try:
        names = sorted(n.name for n in cluster.nodes)
        assert asyncio.run(streams(10)) == (3, names)
        node = cluster.nodes[0]
        node.kill()
        assert node.process is None
        node.start()
        cluster.wait_healthy(30, [node])
        assert asyncio.run(streams(30)) == (3, names)
    finally:
        cluster.cleanup()


def test_the_command_line_runs_a_cluster_until_sigterm_and_starts_a_server_that_dies_again():
    process = subprocess.Popen([sys.executable, "-m", "services.nats_server", "--cluster", "3"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
        urls = re.search(r"up: (\S+)", line).group(1).split(",")
        assert len(urls) == 3, line

        async def reach(servers: list[str]) -> bool:
            nc = await nats.connect(servers=servers, connect_timeout=2, max_reconnect_attempts=20)
            await nc.close()
            return True
        assert asyncio.run(reach(urls))
        servers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(servers) == 3
        os.kill(int(servers[0]), signal.SIGKILL)  # a user trying a failover
        while "starting it again" not in (said := process.stdout.readline()):
            assert said, "the command line exited instead"
        assert asyncio.run(reach(urls)) and process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
