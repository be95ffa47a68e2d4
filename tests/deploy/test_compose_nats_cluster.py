"""docker-compose.yml's NATS is a cluster of three (issue #20): each server's compose command and
environment, run here with the repository's nats-server (tests/deploy/compose_nats.py), joins the
other two with the route password (a server without it is refused), JetStream forms with three
peers, and the jobs service's user and replica setting make the jobs streams with a copy on every
server; every orca service is given the whole server list."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import PurePosixPath

import nats
import pytest

from services.bus import server_urls
from services.jobs.service import ensure_streams
from services.nats_server import free_port, nats_server_binary
from shared import subjects
from tests.deploy.compose_nats import (CLIENT_PORT, CLUSTER_PORT, ROOT, ComposeNatsCluster, compose, environment,
                                       nats_services)

NATS_USERS = ("gateway", "tokenizer", "admission", "engine", "jobs")


def test_the_compose_nats_services_are_three_of_one_kind():
    """nats-1..3: the same command but for each one's name, each its own volume for its store, the
    config file and the file it includes mounted beside each other."""
    services = compose()["services"]
    names = nats_services()
    assert names == ["nats-1", "nats-2", "nats-3"]
    commands = {n: services[n]["command"] for n in names}
    for name, command in commands.items():
        assert command[command.index("-n") + 1] == name
        unnamed = [a for a in command if a != name]
        assert unnamed == [a for a in commands["nats-1"] if a != "nats-1"]
    stores = {n: next(v.split(":")[0] for v in services[n]["volumes"] if v.split(":")[1] == "/data") for n in names}
    assert len(set(stores.values())) == len(names) and set(stores.values()) <= set(compose()["volumes"])
    for name in names:
        command, mounts = commands[name], {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
        config = command[command.index("-c") + 1]
        assert mounts[config].startswith("./") and (ROOT / mounts[config]).is_file()
        for included in re.findall(r"^include\s+(\S+)", (ROOT / mounts[config]).read_text(), flags=re.M):
            beside = str(PurePosixPath(config).parent / included)
            assert beside in mounts, (name, included)
            assert (ROOT / mounts[config]).parent / included == ROOT / mounts[beside]
    published = [p for n in names for p in services[n]["ports"]]
    assert len(set(published)) == len(published)


def test_every_server_routes_to_all_three_with_the_route_password():
    names = nats_services()
    for name in names:
        env = environment(name)
        assert env["ORCA_NATS_CLUSTER_LISTEN"] == f"0.0.0.0:{CLUSTER_PORT}"
        routes = re.findall(r"nats://route:([^@]+)@([\w.-]+):(\d+)", env["ORCA_NATS_ROUTES"])
        assert sorted(host for _, host, _ in routes) == names
        assert {(password, int(port)) for password, _, port in routes} == {(env["ORCA_NATS_ROUTE_PASSWORD"],
                                                                             CLUSTER_PORT)}


def nats_url_of(service: str) -> str | None:
    command = compose()["services"][service].get("command") or []
    return command[command.index("--nats-url") + 1] if "--nats-url" in command else None


def test_every_orca_service_gets_the_whole_server_list():
    everyone = sorted(f"nats://{n}:{CLIENT_PORT}" for n in nats_services())
    checked = []
    for name, service in compose()["services"].items():
        if not str(service.get("image", "")).startswith("orca-serve"):
            continue
        for url in (nats_url_of(name), environment(name).get("ORCA_NATS_URL")):
            if url is not None:
                assert sorted(server_urls(url)) == everyone, (name, url)
                checked.append(name)
    assert {"engine", "tokenizer", "admission", "jobs", "gateway"} <= set(checked)


def test_the_jobs_service_keeps_a_copy_of_its_streams_on_each_of_three_servers():
    assert int(environment("jobs")["ORCA_JETSTREAM_REPLICAS"]) == min(3, len(nats_services()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = ComposeNatsCluster(tmp_path_factory.mktemp("compose-nats")).start()
    yield cluster
    cluster.stop()


def test_the_compose_commands_start_a_cluster_with_jetstream_on_every_server(cluster):
    names = set(cluster.servers)
    for name, server in cluster.servers.items():
        varz = server.monitor("varz")
        assert varz["server_name"] == name and varz["cluster"]["name"] == "orca"
        remotes = {r.get("remote_name") for r in server.monitor("routez")["routes"]}
        assert remotes == names - {name}, (name, remotes)
        meta = server.monitor("jsz")["meta_cluster"]
        assert meta["cluster_size"] == 3 and meta["leader"] in names, meta


def test_the_jobs_user_makes_streams_with_a_copy_on_every_server(cluster):
    """As the compose jobs service does at start: its user, its replica setting; then a producer
    (the client user) submits a job to the replicated work queue."""
    passwords = environment("nats-1")
    replicas = int(environment("jobs")["ORCA_JETSTREAM_REPLICAS"])

    async def go() -> tuple[list, str]:
        jobs = await nats.connect(servers=[cluster.url_for("jobs", passwords["ORCA_NATS_JOBS_PASSWORD"], n)
                                           for n in cluster.servers], inbox_prefix="_INBOX_jobs")
        client = await nats.connect(cluster.url_for("client", passwords["ORCA_NATS_CLIENT_PASSWORD"], "nats-3"))
        try:
            await ensure_streams(jobs, replicas)
            infos = [await jobs.jetstream().stream_info(name)
                     for name in (subjects.JOBS_STREAM, subjects.JOBS_RESULTS_STREAM)]
            ack = await client.jetstream().publish(subjects.JOBS_SUBMIT, b'{"id": "c1", "prompt": "x"}',
                                                   headers={"Nats-Msg-Id": "c1"}, timeout=10)
            return infos, ack.stream
        finally:
            await client.close()
            await jobs.close()

    infos, stream = asyncio.run(go())
    assert stream == subjects.JOBS_STREAM
    for info in infos:
        peers = {info.cluster.leader, *(p.name for p in info.cluster.replicas)}
        assert info.config.num_replicas == 3 and peers == set(cluster.servers), info.cluster


def test_a_server_without_the_route_password_is_refused(cluster, tmp_path):
    """A route must present the `route` user's password: a server that knows where the cluster
    listens, and not the password, joins nothing (it would see every message otherwise)."""
    target = cluster.servers["nats-1"]
    config = tmp_path / "rogue.conf"
    config.write_text(f"listen: 127.0.0.1:{free_port()}\nserver_name: rogue\n"
                      f"cluster {{ name: orca, listen: 127.0.0.1:{free_port()}, "
                      f"routes: [nats://route:wrong@127.0.0.1:{target.cluster_port}, "
                      f"nats://127.0.0.1:{target.cluster_port}] }}\n")
    rogue = subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(2.0)  # a few attempts of both routes
        assert rogue.poll() is None
        remotes = {r.get("remote_name") for r in target.monitor("routez")["routes"]}
        assert "rogue" not in remotes and remotes == set(cluster.servers) - {"nats-1"}
        assert "authorization violation" in cluster.log("nats-1").lower() or "authentication error" in cluster.log(
            "nats-1").lower()
    finally:
        rogue.kill()
        rogue.wait()
