"""deploy/k8s: the standard kinds validate against Kubernetes' own schemas (kubernetes-validate,
strict: unknown fields fail); the RayService against the fields KubeRay's ray.io/v1 CRD documents,
its pod templates as PodTemplateSpecs, its serveConfigV2 against Ray Serve's own config schema, and
its application builder really builds; and the pieces agree with each other and with compose."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.engine.launch import WorkerLaunch
from services.gateway.state import GatewaySettings
from services.local_ray import RAY_SETTINGS
from shared.config import EngineConfig, ServeConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
CUSTOM_KINDS = ("RayService", "Kustomization")


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return out


def find(kind: str, name: str | None = None) -> dict:
    docs = [d for _, d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(docs) == 1, (kind, name, len(docs))
    return docs[0]


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", [(f"{f}:{d['kind']}/{d['metadata']['name']}", d) for f, d in manifests()
                                      if d["kind"] not in CUSTOM_KINDS])
def test_standard_manifests_validate(name, doc):
    validate(doc)


def test_the_validator_rejects_a_mistyped_field():
    doc = copy.deepcopy(find("Deployment", "tokenizer"))
    doc["spec"]["template"]["spec"]["containers"][0]["comand"] = ["python"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    namespace = kustomization["namespace"]
    assert find("Namespace")["metadata"]["name"] == namespace


def test_nats_config_map_is_the_nats_config_files():
    config_map = find("ConfigMap", "nats-config")
    assert config_map["data"]["nats.conf"] == (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    assert config_map["data"]["cluster.conf"] == (ROOT / "deploy" / "nats" / "cluster.conf").read_text()


def test_nats_runs_as_in_compose():
    """Each server as compose's nats-1 runs, its own name aside (the pod's)."""
    container = find("StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["nats-1"]
    named = [a if a != "nats-1" else "$(POD_NAME)" for a in compose["command"]]
    assert container["args"] == named and container["image"] == compose["image"]
    assert [e["secretRef"]["name"] for e in container["envFrom"]] == ["orca-nats"]


def containers(doc: dict) -> list[dict]:
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    elif doc["kind"] in ("Deployment", "StatefulSet"):
        templates = [doc["spec"]["template"]]
    else:
        return []
    return [c for t in templates for c in (*t["spec"].get("initContainers", []), *t["spec"]["containers"])]


def test_secrets_config_maps_and_services_referenced_exist():
    secret = find("Secret", "orca-nats")
    keys = set(secret["stringData"])
    config_maps = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "ConfigMap"}
    services = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "Service"}
    found = {"secrets": 0, "config maps": 0, "hosts": 0}
    for _, doc in manifests():
        text = yaml.safe_dump(doc)  # keys sorted: secretKeyRef's key before name
        for ref in re.findall(r"secretKeyRef:\s+key: (\S+)\s+name: (\S+)", text):
            assert ref[1] == "orca-nats" and ref[0] in keys, ref
            found["secrets"] += 1
        for name in re.findall(r"configMap:\s+name: (\S+)", text):
            assert name in config_maps, name
            found["config maps"] += 1
        for host in re.findall(r"(?:nats|http)://([a-z0-9-]+):\d+", text):
            assert host in services, (doc["metadata"]["name"], host)
            found["hosts"] += 1
    assert all(found.values()), found


def test_orca_containers_use_the_project_images_and_their_own_nats_user():
    users = set(re.findall(r"^\s+user: (\w+)$", (ROOT / "deploy" / "nats" / "nats.conf").read_text(), flags=re.M))
    seen = set()
    for _, doc in manifests():
        for c in containers(doc):
            if not c["image"].startswith("orca-serve"):
                continue
            assert c["image"] in ("orca-serve:cpu", "orca-serve:cuda"), c["image"]
            env = {e["name"]: e for e in c.get("env", [])}
            if "ORCA_NATS_USER" in env:
                user = env["ORCA_NATS_USER"]["value"]
                assert user in users
                assert env["ORCA_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == f"ORCA_NATS_{user.upper()}_PASSWORD"
                seen.add(user)
    assert {"tokenizer", "admission", "jobs"} <= seen


def without_nats_url(command: list[str]) -> list[str]:
    """The command with its --nats-url value left out: the NATS servers' names are each deployment's own."""
    i = command.index("--nats-url")
    return command[:i + 1] + command[i + 2:]


@pytest.mark.parametrize("service", ["tokenizer", "admission", "jobs"])
def test_service_deployments_run_the_compose_command(service):
    """The same process as in compose (one config for every way of running), on this cluster's NATS."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][service]
    container = find("Deployment", service)["spec"]["template"]["spec"]["containers"][0]
    assert without_nats_url(container["command"]) == without_nats_url(compose["command"])
    assert find("Deployment", "admission")["spec"]["replicas"] == 1  # one global queue


# ---- RayService (ray.io/v1), checked against the fields KubeRay documents ------------------------
# ray-operator/apis/ray/v1/{rayservice,raycluster}_types.go: field -> required. Unknown fields fail
# here (the API server would prune them silently).

RAYSERVICE_SPEC = {"serveConfigV2": False, "rayClusterConfig": True, "upgradeStrategy": False,
                   "serveService": False, "excludeHeadPodFromServeSvc": False,
                   "rayClusterDeletionDelaySeconds": False}
RAYCLUSTER_SPEC = {"headGroupSpec": True, "workerGroupSpecs": False, "rayVersion": False,
                   "enableInTreeAutoscaling": False, "autoscalerOptions": False, "headServiceAnnotations": False,
                   "suspend": False, "gcsFaultToleranceOptions": False, "managedBy": False}
HEAD_GROUP = {"serviceType": False, "headService": False, "enableIngress": False, "rayStartParams": True,
              "template": True, "resources": False, "labels": False}
WORKER_GROUP = {"groupName": True, "replicas": False, "minReplicas": True, "maxReplicas": True, "numOfHosts": False,
                "rayStartParams": True, "template": True, "scaleStrategy": False, "idleTimeoutSeconds": False,
                "suspend": False, "resources": False, "labels": False}
AUTOSCALER_OPTIONS = {"resources": False, "image": False, "imagePullPolicy": False, "env": False, "envFrom": False,
                      "volumeMounts": False, "securityContext": False, "idleTimeoutSeconds": False,
                      "upscalingMode": False, "version": False}


def check_fields(obj: dict, fields: dict[str, bool], where: str) -> list[str]:
    problems = [f"{where}: unknown field {k!r}" for k in obj if k not in fields]
    problems += [f"{where}: missing {k!r}" for k, required in fields.items() if required and k not in obj]
    return problems


def pod_template_problems(template: dict, where: str) -> list[str]:
    try:
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}.template: {exc}"]
    return []


def rayservice_problems(doc: dict) -> list[str]:
    problems = []
    if doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") != "RayService":
        problems.append("apiVersion/kind must be ray.io/v1 RayService")
    problems += check_fields(doc, {"apiVersion": True, "kind": True, "metadata": True, "spec": True}, "")
    spec = doc.get("spec", {})
    problems += check_fields(spec, RAYSERVICE_SPEC, "spec")
    if not isinstance(spec.get("serveConfigV2", ""), str):
        problems.append("spec.serveConfigV2 must be a YAML string")
    strategy = spec.get("upgradeStrategy", {}).get("type")
    if strategy is not None and strategy not in ("NewCluster", "None", "NewClusterWithIncrementalUpgrade"):
        problems.append(f"spec.upgradeStrategy.type {strategy!r}")
    cluster = spec.get("rayClusterConfig", {})
    problems += check_fields(cluster, RAYCLUSTER_SPEC, "rayClusterConfig")
    problems += check_fields(cluster.get("autoscalerOptions", {}), AUTOSCALER_OPTIONS, "autoscalerOptions")
    mode = cluster.get("autoscalerOptions", {}).get("upscalingMode")
    if mode is not None and mode not in ("Default", "Aggressive", "Conservative"):
        problems.append(f"autoscalerOptions.upscalingMode {mode!r}")
    head = cluster.get("headGroupSpec", {})
    problems += check_fields(head, HEAD_GROUP, "headGroupSpec")
    groups = [("headGroupSpec", head)]
    names = []
    for i, group in enumerate(cluster.get("workerGroupSpecs", [])):
        where = f"workerGroupSpecs[{i}]"
        problems += check_fields(group, WORKER_GROUP, where)
        names.append(group.get("groupName"))
        low, n, high = group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 2**31 - 1)
        if not 0 <= low <= n <= high:
            problems.append(f"{where}: need 0 <= minReplicas <= replicas <= maxReplicas, got {low}, {n}, {high}")
        groups.append((where, group))
    if len(names) != len(set(names)):
        problems.append(f"worker group names repeat: {names}")
    for where, group in groups:
        params = group.get("rayStartParams", {})
        problems += [f"{where}.rayStartParams.{k}: values are strings" for k, v in params.items()
                     if not isinstance(v, str)]
        problems += pod_template_problems(group.get("template", {}), where)
    return problems


def test_rayservice_has_kuberays_documented_shape():
    assert rayservice_problems(find("RayService")) == []


@pytest.mark.parametrize("breakage", ["typo", "missing template", "int param", "replicas", "upscaling", "pod"])
def test_the_rayservice_checker_catches_mistakes(breakage):
    doc = copy.deepcopy(find("RayService"))
    cluster = doc["spec"]["rayClusterConfig"]
    worker = cluster["workerGroupSpecs"][0]
    if breakage == "typo":
        cluster["workerGroupSpec"] = cluster.pop("workerGroupSpecs")
    elif breakage == "missing template":
        del cluster["headGroupSpec"]["template"]
    elif breakage == "int param":
        worker["rayStartParams"]["num-gpus"] = 1
    elif breakage == "replicas":
        worker["minReplicas"] = worker["maxReplicas"] + 1
    elif breakage == "upscaling":
        cluster["autoscalerOptions"]["upscalingMode"] = "Fast"
    elif breakage == "pod":
        worker["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    assert rayservice_problems(doc)


def test_rayservice_scales_gpu_workers_and_keeps_them_off_the_head():
    cluster = find("RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    [gpu] = cluster["workerGroupSpecs"]
    assert gpu["maxReplicas"] > gpu["minReplicas"]
    container = gpu["template"]["spec"]["containers"][0]
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == gpu["rayStartParams"]["num-gpus"] == "1"
    assert gpu["rayStartParams"]["num-cpus"] == "1"  # one engine worker (it asks Ray for one CPU) per GPU pod
    images = {c["image"] for c in containers(find("RayService"))}
    assert images == {"orca-serve:cuda"}  # one Python (and Ray) across the cluster


def test_every_ray_pod_holds_the_password_of_every_deployment_serve_may_place_on_it():
    """Masters and gateway replicas ask for no resources, so Serve places them on any pod: each pod needs
    the NATS password of each deployment's user (a gateway replica on a GPU pod logged in as `gateway`
    with no password, refused once a minute, for ever), and the API key the gateway requires."""
    cluster = find("RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        [container] = pod["template"]["spec"]["containers"]
        names = {e["name"] for e in container.get("env", [])}
        assert {"ORCA_NATS_GATEWAY_PASSWORD", "ORCA_NATS_ENGINE_PASSWORD", "ORCA_API_KEY"} <= names, names


def test_every_ray_pod_runs_ray_with_the_settings_orca_serve_gives_its_own_ray():
    """The raylet reads them from its environment (services/local_ray.py RAY_SETTINGS): model workers at
    normal priority, a hung worker or master SIGKILLed 1 s after its kill, not Ray's 5 s."""
    cluster = find("RayService")["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        [container] = pod["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert {name: env.get(name) for name in RAY_SETTINGS} == RAY_SETTINGS


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(find("RayService")["spec"]["serveConfigV2"])


def test_serve_config_passes_ray_serves_schema():
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config())


def test_serve_application_builds_from_its_import_path_and_args():
    """The builder KubeRay's Serve controller will call, with the manifest's args: it parses the
    engine flags like `orca serve` and returns an application with the deployments configured."""
    import importlib

    from ray.serve import Application

    from services import rayservice

    [application] = serve_config()["applications"]
    module, _, attr = application["import_path"].partition(":")
    built = getattr(importlib.import_module(module), attr)(application["args"])
    assert isinstance(built, Application)
    gateway_settings, engines = built._bound_deployment.init_args
    engine_config, nats_url, launch_settings = engines._bound_deployment.init_args
    assert isinstance(gateway_settings, GatewaySettings) and gateway_settings.nats_url == nats_url
    assert isinstance(engine_config, EngineConfig), engine_config
    assert isinstance(launch_settings, ServeConfig), "the engine got another deployment's settings"
    WorkerLaunch.of(launch_settings)  # what EngineReplica does with them first
    configured = {d["name"] for d in application["deployments"]}
    assert configured <= {rayservice.ENGINE_DEPLOYMENT, rayservice.GATEWAY_DEPLOYMENT}
    config, settings = rayservice.engine_config(application["args"]["engine_args"])
    assert config.model.device == "cuda" and config.model.model == "/models/demo-llama-tiny"
    assert settings.worker_threads == 4 and settings.step_timeout == ServeConfig().step_timeout
    with pytest.raises(ValueError, match="engine_args"):
        rayservice.engine_config(["--no-such-flag"])
    with pytest.raises(ValueError, match="step_timeout"):
        rayservice.engine_config(["--model", "/m", "--step-timeout", "0"])


def test_the_rayservice_engine_replica_fails_its_health_check_when_its_master_hangs(monkeypatch):
    """`--hang-timeout` under the RayService: a master that answers no ping for that long (after its
    start-up grace) fails the replica's health check, so Serve restarts it; one that answers never does."""
    import ray

    from services import rayservice

    answered: set = set()
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([r for r in refs if r in answered], []))
    clock = [1000.0]
    monkeypatch.setattr(rayservice.time, "monotonic", lambda: clock[0])

    class Master:
        def __init__(self) -> None:
            self.pings: list[object] = []
            self.ping = self

        def remote(self) -> object:
            self.pings.append(object())
            return self.pings[-1]

    replica = rayservice.EngineReplica.__new__(rayservice.EngineReplica)
    replica.replica, replica.master, replica.running = "r0", Master(), object()
    replica.hang_timeout_s, replica.ping, replica.ping_sent_at, replica.grace_until = 10.0, None, 0.0, 1060.0
    replica.check_health()  # a ping goes out
    clock[0] += 30
    replica.check_health()  # 30 s without an answer, but still loading the model: no verdict
    answered.add(replica.master.pings[-1])
    for _ in range(5):  # it answers every ping
        clock[0] += 10
        replica.check_health()
        answered.add(replica.master.pings[-1])
    clock[0] += 10
    replica.check_health()  # a new ping
    clock[0] += 11
    with pytest.raises(RuntimeError, match="answered nothing for 11 s"):
        replica.check_health()
