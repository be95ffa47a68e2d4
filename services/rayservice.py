"""The Ray Serve application that a KubeRay RayService runs (deploy/k8s/rayservice.yaml):

    serveConfigV2:
      applications:
        - import_path: services.rayservice:app
          args: {nats_url: ..., engine_replicas: 1, engine_args: ["--model", "/models/...", "--worker-threads", "4"]}

Two deployments. `orca-engine`: each replica owns one engine replica, an engine master actor that
starts its workers as Ray actors (the Orca loop talks to the rest over NATS, as everywhere else);
Serve restarts a replica whose master stopped, and its workers go with it. `orca-gateway`: the
OpenAI-compatible HTTP gateway, the ingress (autoscaled on ongoing requests). `engine_args` are the
flags of `python -m services.engine` (the engine's and its launch settings: --worker-threads,
--worker-cpus, --step-timeout, ...), parsed by its parser, so ORCA_<FIELD> variables work here too.
Each deployment connects to NATS as its own user (ORCA_NATS_USER in its runtime env; the pod holds
ORCA_NATS_<USER>_PASSWORD: shared/env.py).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from ray import serve

from services.cli import engine_config_from_args
from services.engine.launch import START_GRACE_S, WorkerLaunch, launch_master, replica_parser
from services.gateway.app import RayGateway
from services.gateway.state import GatewaySettings
from shared import env
from shared.config import EngineConfig, ServeConfig
from shared.flags import serve_config_from_args

AUTOSCALER_WAIT_S = 900.0
"""How long an engine waits for KubeRay's autoscaler to add a pod with the devices it lacks (a GPU pod's
start, its image pull included, takes minutes)."""
ENGINE_DEPLOYMENT = "orca-engine"
GATEWAY_DEPLOYMENT = "orca-gateway"


class AppArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nats_url: str
    """NATS inside the cluster, e.g. nats://nats:4222 (credentials come from the environment)."""
    engine_args: list[str]
    """`python -m services.engine` flags: the engine's (`--model` names a checkpoint directory present on
    every Ray pod) and its launch settings (`--worker-threads`, `--worker-cpus`, `--step-timeout`)."""
    engine_replicas: int = 1
    """Engine replicas (model copies): Serve's replicas of the engine deployment."""
    served_model_name: str | None = None


class EngineReplica:
    """One engine replica: its master runs as a child actor (fate-shared with this replica)."""

    def __init__(self, config: EngineConfig, nats_url: str, settings: ServeConfig) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        launch = WorkerLaunch.of(settings, autoscaler_wait_s=AUTOSCALER_WAIT_S)
        self.master = launch_master(config, nats_url, self.replica, launch, restarted_by_ray=False)
        self.running = self.master.run.remote()
        self.hang_timeout_s = settings.hang_timeout
        self.ping: Any = None
        self.ping_sent_at = 0.0
        self.grace_until = time.monotonic() + START_GRACE_S  # loading the model: no answer yet is no hang

    def check_health(self) -> None:
        """Serve calls this periodically. A master that returned or failed, or one that has answered no
        ping for `--hang-timeout` seconds (a blocked loop, a SIGSTOP), restarts the replica (and its
        master and workers with it): the RayService's form of `orca serve`'s MasterSupervisor."""
        import ray

        done, _ = ray.wait([self.running], timeout=0)
        if done:
            ray.get(self.running)  # raises the master's error
            raise RuntimeError(f"engine replica {self.replica} stopped")
        now = time.monotonic()
        if self.ping is not None and ray.wait([self.ping], timeout=0)[0]:
            self.ping, self.grace_until = None, 0.0  # it answers: from now on silence means a hang
        if self.ping is None:
            self.ping, self.ping_sent_at = self.master.ping.remote(), now
        elif now - self.ping_sent_at > self.hang_timeout_s and now > self.grace_until:
            raise RuntimeError(f"engine replica {self.replica}: its master answered nothing for "
                               f"{now - self.ping_sent_at:.0f} s (hung; --hang-timeout {self.hang_timeout_s:g})")


class Gateway(RayGateway):
    """The HTTP gateway; it holds the engine deployment's handle so that one application deploys both."""

    def __init__(self, settings: GatewaySettings, engines: Any) -> None:
        super().__init__(settings)
        self.engines = engines


def engine_config(engine_args: list[str]) -> tuple[EngineConfig, ServeConfig]:
    """The flags parsed exactly as `python -m services.engine` parses them: the engine's config and
    the replica's launch settings."""
    try:
        args = replica_parser("engine_args").parse_args(engine_args)
    except SystemExit:  # argparse has printed why; the Serve controller needs an exception
        raise ValueError(f"bad engine_args {engine_args}") from None
    return engine_config_from_args(args), serve_config_from_args(args)


def app(args: dict[str, Any]) -> serve.Application:
    """The application builder named by serveConfigV2's import_path."""
    parsed = msgspec.convert(args, AppArgs)
    config, settings = engine_config(parsed.engine_args)
    engines = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=parsed.engine_replicas,
                               ray_actor_options={"num_cpus": 0,
                                                  "runtime_env": {"env_vars": {"ORCA_NATS_USER": "engine"}}})
    gateway = serve.deployment(serve.ingress()(Gateway), name=GATEWAY_DEPLOYMENT, max_ongoing_requests=4096,
                               graceful_shutdown_timeout_s=5,
                               ray_actor_options={"num_cpus": 0,
                                                  "runtime_env": {"env_vars": {"ORCA_NATS_USER": "gateway"}}})
    gateway_settings = GatewaySettings(nats_url=parsed.nats_url, model=config.model.model,
                                       served_model_name=parsed.served_model_name, api_key=env.api_key(),
                                       chat_template=config.model.chat_template)
    return gateway.bind(gateway_settings, engines.bind(config, parsed.nats_url, settings))
