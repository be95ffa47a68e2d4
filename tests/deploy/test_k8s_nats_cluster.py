"""deploy/k8s/nats.yaml is a NATS cluster of three (issue #20): a StatefulSet whose pods find each
other through the headless service (before they are ready: none is until the cluster forms), route
to every pod with the route password, keep a quorum through voluntary evictions; every orca
container connects with the whole list of pods; the jobs service keeps three copies of its
streams. The cluster config is the one compose runs (tests/deploy/test_compose_nats_cluster.py
starts it)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from services.bus import server_urls
from tests.deploy.test_k8s import K8S, find, manifests

CLIENT_PORT, CLUSTER_PORT = 4222, 6222


def statefulset() -> dict:
    return find("StatefulSet", "nats")


def nats_container() -> dict:
    return statefulset()["spec"]["template"]["spec"]["containers"][0]


def pod_hosts() -> list[str]:
    """The DNS name of each NATS pod: <statefulset>-<i>.<headless service>."""
    spec = statefulset()["spec"]
    return [f"{statefulset()['metadata']['name']}-{i}.{spec['serviceName']}" for i in range(spec["replicas"])]


def test_three_servers_that_start_together_and_find_each_other_before_ready():
    spec = statefulset()["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"  # ordered start would wait for a pod that waits for a quorum
    headless = find("Service", spec["serviceName"])["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"] == spec["selector"]["matchLabels"]
    assert {p["name"]: p["port"] for p in headless["ports"]}["cluster"] == CLUSTER_PORT
    ports = {p["name"]: p["containerPort"] for p in nats_container()["ports"]}
    assert ports["cluster"] == CLUSTER_PORT and ports["client"] == CLIENT_PORT


def test_each_pod_routes_to_every_pod_with_the_route_password():
    container = nats_container()
    env = [e["name"] for e in container["env"]]
    values = {e["name"]: e for e in container["env"]}
    assert values["ORCA_NATS_CLUSTER_LISTEN"]["value"] == f"0.0.0.0:{CLUSTER_PORT}"
    routes = re.findall(r"nats://route:([^@]+)@([\w.-]+):(\d+)", values["ORCA_NATS_ROUTES"]["value"])
    assert [host for _, host, _ in routes] == pod_hosts()
    assert {(password, int(port)) for password, _, port in routes} == {("$(ORCA_NATS_ROUTE_PASSWORD)", CLUSTER_PORT)}
    # Kubernetes expands $(NAME) only from variables defined before it.
    assert env.index("ORCA_NATS_ROUTE_PASSWORD") < env.index("ORCA_NATS_ROUTES")
    ref = values["ORCA_NATS_ROUTE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in find("Secret", ref["name"])["stringData"]
    name_arg = container["args"][container["args"].index("-n") + 1]
    assert name_arg == "$(POD_NAME)" and values["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    config = container["args"][container["args"].index("-c") + 1]
    data = find("ConfigMap", "nats-config")["data"]
    assert config.startswith(mount["mountPath"] + "/") and config.rsplit("/", 1)[1] in data and "nats.conf" in data


def test_voluntary_evictions_keep_a_quorum():
    budget = find("PodDisruptionBudget", "nats")["spec"]
    assert budget["maxUnavailable"] == 1 and budget["selector"] == statefulset()["spec"]["selector"]


def nats_urls() -> list[tuple[str, str]]:
    """(where, URL) of every NATS URL an orca container or the Serve application is given."""
    found = []
    for _, doc in manifests():
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if "--nats-url" in c.get("command", []):
                    found.append((doc["metadata"]["name"], c["command"][c["command"].index("--nats-url") + 1]))
        if doc["kind"] == "RayService":
            for app in yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]:
                found.append((f"serve:{app['name']}", app["args"]["nats_url"]))
    return found


def test_every_orca_service_connects_with_every_nats_pod():
    everyone = [f"nats://{host}:{CLIENT_PORT}" for host in pod_hosts()]
    urls = nats_urls()
    assert {"tokenizer", "admission", "jobs", "serve:orca"} <= {where for where, _ in urls}
    for where, url in urls:
        assert server_urls(url) == everyone, where


def test_the_jobs_service_keeps_a_copy_of_its_streams_on_three_servers():
    container = find("Deployment", "jobs")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["ORCA_JETSTREAM_REPLICAS"]) == min(3, statefulset()["spec"]["replicas"])


def test_kustomize_builds_every_manifest():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    kinds = re.findall(r"^kind: (\w+)$", built.stdout, flags=re.M)
    expected = [d["kind"] for _, d in manifests() if d["kind"] != "Kustomization"]
    assert sorted(kinds) == sorted(expected)
    assert "PodDisruptionBudget" in kinds and kinds.count("Service") >= 3
