"""`orca serve`: the whole system on this machine, or attached to existing NATS / Ray.

Starts (unless pointed elsewhere) a local nats-server and a local Ray, the engine masters
and their workers as Ray actors, and the tokenizer and admission services as processes
(`python -m services.<name>`, as docker-compose runs them). It supervises them: a service
process that exits or hangs is restarted with backoff (services/supervise.py), an engine master
that dies or hangs is restarted through Ray (services/engine/launch.py), and the rest keep
serving meanwhile. Stays up until Ctrl-C or SIGTERM, then drains: the tokenizer refuses new requests (HTTP clients get 503) and lets those
in flight finish for up to --drain-timeout seconds (the rest end with an error event), the jobs
service stops pulling and lets its jobs finish (the rest are redelivered on the next start);
then it stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from services.cpu_binding import CpuLayout, available_cpus, bind_process_tree, can_bind, plan_cpu_layout
from services.local_ray import RayCluster, apply_ray_settings
from services.ports import PortReservation, port_number
from services.supervise import SupervisedProcess, stop_processes
from shared import env, subjects
from shared.codec import Codec
from shared.config import EngineConfig, ServeConfig
from shared.flags import add_serve_flags
from shared.messages import EngineStatus

log = logging.getLogger("orca.serve")
status_codec = Codec(EngineStatus)
GATEWAY_FLUSH_S = 0.2
"""After the gateway replica has answered its last request, time for Serve's proxy to pass it on."""


def ensure_demo_model() -> str:
    path = env.cache_dir() / "demo-llama-tiny"
    if not (path / "config.json").is_file():
        from model.demo import make_demo_model

        print(f"making the demo model (first run) in {path} ...", file=sys.stderr)
        make_demo_model(path, arch="llama", size="tiny")
    return str(path)


def service_command(name: str, nats_url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", f"services.{name}", "--nats-url", nats_url, *extra]


def default_worker_threads(cpus: int, workers: int) -> int:
    """Torch threads per worker: the machine's cores less one, shared by the workers. Ray would pin an
    actor's OpenMP threads to its CPU count (1). The core left over is the control plane's (gateway,
    tokenizer, master, NATS), as vLLM's CPU build leaves one: an OpenMP team on every core runs at the
    pace of whichever thread the control plane preempted. Measured on this 2-core VM, tiny Llama,
    orca bench: 1 thread against 2 served 3,681 vs 3,084 out tok/s over HTTP (4,416 vs 4,155 over NATS)
    at rate inf, and a single stream's median TPOT was 2.5 vs 4.2 ms."""
    return max(1, (cpus - 1) // workers)


def check_engines_fit(config: EngineConfig, settings: ServeConfig, local_cpus: int | None = None) -> None:
    """ValueError, with the numbers, if the connected Ray cluster (or, given `local_cpus`, the local Ray
    that orca serve would start with them) cannot hold every replica's workers at all (each master
    checks its own again; one that is only busy waits for room)."""
    from services.engine.placement import cluster_shortfall, worker_bundle

    if local_cpus is None:
        import ray

        total, where = ray.cluster_resources(), {}
    else:
        total = {"CPU": float(local_cpus)}
        where = {"cluster": "a local Ray on this machine", "grow": "serve from a larger Ray cluster (--ray-address)"}
    parallel = config.parallel
    what = (f"{settings.replicas} engine replica(s) of tp={parallel.tensor_parallel_size} "
            f"pp={parallel.pipeline_parallel_size}")
    shortfall = cluster_shortfall(settings.replicas * parallel.world_size,
                                  worker_bundle(config.model.device, settings.worker_cpus), total, what=what,
                                  **where)
    if shortfall:
        raise ValueError(shortfall)


def starts_local_ray(ray_address: str | None) -> bool:
    """Whether `ray.init(address=ray_address)` would start a new local Ray rather than join one (given
    no address, Ray joins the one RAY_ADDRESS names or the latest `ray start` here); False when unsure."""
    if ray_address is not None:
        return False
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment(None, None) is None
    except Exception:  # noqa: BLE001 - a Ray without this helper: Ray's own check after it starts applies
        return False


def start_engines(config: EngineConfig, nats_url: str, settings: ServeConfig, worker_threads: int,
                  layout: CpuLayout | None) -> list:
    """A supervisor per engine replica, its master running (its `run` call fails at once if, say,
    the cluster cannot place its workers: `wait_until_ready` says so)."""
    from services.engine.launch import MasterSupervisor, WorkerLaunch, launch_master

    world = config.parallel.world_size
    # A lone worker may borrow the control plane's cores (services/cpu_binding.py); several would fight over them.
    borrow = layout.control if layout is not None and len(layout.workers) == 1 else ()
    launches = [WorkerLaunch.of(settings, worker_threads=worker_threads,
                                worker_cores=layout.workers[i * world:(i + 1) * world] if layout else None,
                                borrow_cores=borrow)
                for i in range(settings.replicas)]
    now = time.monotonic()
    return [MasterSupervisor(str(i), launch_master(config, nats_url, str(i), launch),
                             hang_timeout_s=settings.hang_timeout).start(now)
            for i, launch in enumerate(launches)]


def cpu_layout(args: argparse.Namespace, config: EngineConfig, workers: int, threads: int) -> CpuLayout | None:
    """Where `--cpu-bind auto` puts the workers and the control plane: only for CPU workers of a
    local Ray (a cluster's workers run on other machines' cores)."""
    if args.cpu_bind == "off" or config.model.device != "cpu" or args.ray_address is not None or not can_bind():
        return None
    return plan_cpu_layout(available_cpus(), workers, threads)


def start_services(settings: ServeConfig, nats_url: str, config: EngineConfig,
                   run_dir: Path) -> dict[str, SupervisedProcess]:
    """The tokenizer, admission and jobs processes, supervised. The tokenizer says "drained" on a
    pipe (see `_drain`)."""
    drain = ["--drain-timeout", str(settings.drain_timeout)]
    model = ["--model", config.model.model]
    if config.model.chat_template is not None:
        model += ["--chat-template", config.model.chat_template]
    commands = {
        "tokenizer": lambda extra: service_command("tokenizer", nats_url, *model, *drain, *extra),
        "admission": lambda extra: service_command("admission", nats_url,
                                                   "--max-queue-len", str(settings.max_queue_len), *extra),
        "jobs": lambda extra: service_command("jobs", nats_url, *drain, "--jobs-ack-wait", str(settings.jobs_ack_wait),
                                              *extra),
    }
    now = time.monotonic()
    return {name: SupervisedProcess(name, command, run_dir / f"{name}.alive",
                                    hang_timeout_s=settings.hang_timeout, drained_pipe=name == "tokenizer").start(now)
            for name, command in commands.items()}


async def wait_until_ready(nats_url: str, replicas: int, timeout_s: float, runs: list = (),
                           stopping: Callable[[], bool] = lambda: False) -> None:
    """Until every engine reports ready and a tokenizer answers a probe, or `stopping()` (a Ctrl-C
    while it starts); raises at once if an engine's `run` (a Ray call) ended, which it only does on
    failure, and ValueError once `timeout_s` has passed (NATS unreachable, engines not ready)."""
    deadline = time.monotonic() + timeout_s
    nc = await _connect_until(nats_url, deadline, timeout_s, stopping)
    if nc is None:
        return
    ready: set[str] = set()
    got_all = asyncio.Event()

    async def on_status(msg) -> None:
        status = status_codec.decode(msg.data)
        if status.ready:
            ready.add(status.replica)
            if len(ready) >= replicas:
                got_all.set()

    await nc.subscribe(subjects.ENGINE_STATUS, cb=on_status)
    try:
        while not got_all.is_set():
            if time.monotonic() > deadline:
                raise ValueError(f"engines not ready after {timeout_s:.0f} s ({len(ready)}/{replicas} ready; "
                                 "--startup-timeout)")
            print(f"  waiting for engines: {len(ready)}/{replicas} ready", file=sys.stderr)
            for _ in range(10):
                if stopping():
                    return
                _raise_if_ended(runs)
                try:
                    await asyncio.wait_for(got_all.wait(), timeout=0.5)
                    break
                except asyncio.TimeoutError:
                    pass
        while not stopping():
            try:
                await nc.request(subjects.GENERATE, b"{}", timeout=2)
                return
            except Exception:  # noqa: BLE001 - the tokenizer is still starting
                if time.monotonic() > deadline:
                    raise ValueError(f"the tokenizer service did not answer within {timeout_s:.0f} s "
                                     "(--startup-timeout)") from None
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


def check_ray_address_answers(address: str | None, timeout_s: float = 5.0) -> None:
    """A `--ray-address host:port` that nothing listens on is one line at once: Ray's own connect waits for
    its GCS there for minutes. ("auto" and ray:// addresses are left to Ray.)"""
    import socket

    if address is None or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--ray-address {address}: not host:port, auto or ray://...")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


async def _connect_until(nats_url: str, deadline: float, timeout_s: float, stopping: Callable[[], bool]):
    """The probe's NATS connection; None if `stopping()` first. A server that does not answer is waited
    for (it may be starting beside this one) until the deadline, saying so once."""
    from services.bus import CredentialsRefused, abandon_connect, connect, redact_url

    started, said = time.monotonic(), False
    connecting = asyncio.ensure_future(connect(nats_url, "orca-serve-probe"))
    try:
        while not connecting.done():
            if stopping():
                return None
            if time.monotonic() > deadline:
                raise ValueError(f"NATS at {redact_url(nats_url)} did not answer within {timeout_s:.0f} s "
                                 "(--startup-timeout): is it running, and is the URL right?")
            if not said and time.monotonic() - started > 2.0:
                print(f"  waiting for NATS at {redact_url(nats_url)}", file=sys.stderr)
                said = True
            await asyncio.wait({connecting}, timeout=0.25)
        return connecting.result()
    except CredentialsRefused as exc:
        raise ValueError(str(exc)) from None
    finally:
        if not connecting.done():
            await abandon_connect(connecting)


def _raise_if_ended(runs: list) -> None:
    import ray

    done, _ = ray.wait(list(runs), timeout=0, num_returns=len(runs)) if runs else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise ValueError(f"an engine failed to start: {cause}") from None
        raise ValueError("an engine stopped while starting")


def serve(args: argparse.Namespace, config: EngineConfig, settings: ServeConfig) -> int:
    import ray

    from services.nats_server import LocalNatsServer

    if config.model.device == "cpu" and starts_local_ray(args.ray_address):
        # The local Ray it starts has this machine's CPUs at most: a split they cannot hold fails here,
        # in a second, not after Ray's start (5-20 s). A cluster is checked once connected, below.
        check_engines_fit(config, settings, local_cpus=os.cpu_count() or 1)
    http_port = PortReservation(args.host, args.port)  # before starting anything: a taken port fails at once
    args.port = http_port.port
    stop = {"now": False}
    # Ray prints the actors' warnings and errors here: line by line also into a pipe (docker logs, a
    # supervisor), not in blocks that a crash would lose
    sys.stdout.reconfigure(line_buffering=True)
    if not sys.stdout.isatty():  # Ray colours each actor's prefix; a pipe or a file gets plain text
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")

    def on_signal(signum, frame) -> None:
        stop["now"] = True

    def stopping() -> bool:  # a Ctrl-C or SIGTERM while starting stops the start, not only the serving
        return stop["now"]

    workers = settings.replicas * config.parallel.world_size
    threads = settings.worker_threads or default_worker_threads(len(available_cpus()), workers)
    layout = cpu_layout(args, config, workers, threads)
    if layout is not None:
        print(f"cores: control plane {list(layout.control)}, workers {[list(w) for w in layout.workers]}, "
              f"once up (--cpu-bind off to leave them unbound)", flush=True)
    with ExitStack() as stack:
        stack.callback(http_port.release)
        nats_url = args.nats_url
        if nats_url is None:
            server = LocalNatsServer().start(die_with_parent=True)  # from the main thread: dies with orca serve
            stack.callback(server.cleanup)
            nats_url = server.url
        apply_ray_settings()
        # Serve checks its HTTP proxy every 10 s and restarts it after three failed checks: half a
        # minute without HTTP after the proxy dies. Every 2 s brings that under 10 s (a local Ray only).
        os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "2")
        cluster = RayCluster(owned=args.ray_address is None)
        check_ray_address_answers(args.ray_address)
        try:
            # log_to_driver: the engine's and the gateway's warnings and errors reach this terminal (each
            # prefixed with its actor); Serve's INFO lines and access log stay in its log files
            ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
        except ConnectionError as exc:  # --ray-address names no running cluster: one line, not Ray's traceback
            raise ValueError(f"--ray-address {args.ray_address}: {exc}") from None
        if args.log_level != "DEBUG":  # Serve's INFO lines name its unused proxy's port, not the gateway's
            import ray.serve  # noqa: F401 - its import sets its logger to INFO: quieten it after

            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        stack.callback(cluster.shutdown)
        check_engines_fit(config, settings)  # before the services start: a split that cannot fit fails in seconds
        # After ray.init, which installs handlers of its own; children run in their own sessions so a
        # terminal's Ctrl-C reaches only this process, which then stops them in order.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        run_dir = Path(tempfile.mkdtemp(prefix="orca-serve-"))  # the services' liveness files
        stack.callback(shutil.rmtree, run_dir, True)
        services = start_services(settings, nats_url, config, run_dir)
        stack.callback(stop_processes, list(services.values()))
        masters = start_engines(config, nats_url, settings, threads, layout)
        stack.callback(_stop_masters, [m.actor for m in masters], cluster)
        # The engines first: a split the cluster cannot place fails here, before Serve starts (starting Serve
        # meanwhile saved about 1 s of the 20 to "up", and made that failure 35 s slower)
        asyncio.run(wait_until_ready(nats_url, settings.replicas, settings.startup_timeout,
                                     [m.run_ref for m in masters], stopping))
        if not stop["now"]:
            http_url = start_gateway(args, nats_url, config, http_port)
            stack.callback(_stop_gateway, settings.drain_timeout, cluster)
            wait_until_healthy(http_url, timeout_s=30.0, stopping=stopping)
        if stop["now"]:
            print("orca-serve: stopped while starting", file=sys.stderr, flush=True)
        else:
            if layout is not None:  # now, not before: start-up would queue on the control plane's cores
                bind_process_tree(os.getpid(), layout.control, {core for cores in layout.workers for core in cores})
            print_up(http_url, nats_url, settings.replicas, config.model.model)
            while not stop["now"]:
                supervise(list(services.values()), masters)
                time.sleep(0.2)
        cluster.check_gone()  # first: a gone cluster's leftovers would slow the drain
        print("orca-serve: draining", file=sys.stderr, flush=True)
        _drain(services["tokenizer"], services["jobs"], settings.drain_timeout, at_once=cluster.gone)
        print("orca-serve: stopping", file=sys.stderr, flush=True)
    cluster.exit_now_if_gone(0)
    return 0


def print_up(http_url: str, nats_url: str, replicas: int, model: str) -> None:
    from services.bus import redact_url

    print(f"orca-serve is up: HTTP {http_url}, NATS {redact_url(nats_url)}, {replicas} engine replica(s) of {model}\n"
          f"  openai:   {http_url}/v1 (completions, chat/completions, models); health: {http_url}/health\n"
          f"  generate: publish JSON to '{subjects.GENERATE}' with a reply subject\n"
          f"  abort:    publish {{\"id\": ...}} to '{subjects.ABORT}'\n"
          f"  jobs:     JetStream publish to '{subjects.JOBS_SUBMIT}' (Nats-Msg-Id header), "
          f"results on '{subjects.JOBS_RESULT_PREFIX}.<id>'\n"
          f"Ctrl-C or SIGTERM stops everything.", flush=True)


def supervise(services: list[SupervisedProcess], masters: list) -> None:
    """One round: restart what died, kill what hangs (to be restarted)."""
    now, wall_now = time.monotonic(), time.time()
    for service in services:
        service.check(now, wall_now)
    for master in masters:
        master.check(now)


def start_gateway(args: argparse.Namespace, nats_url: str, config: EngineConfig, http_port: PortReservation) -> str:
    """The OpenAI-compatible HTTP gateway as a Ray Serve deployment; returns its URL."""
    from services.gateway.app import start_on_ray_serve
    from services.gateway.state import GatewaySettings

    settings = GatewaySettings(nats_url=nats_url, model=config.model.model, served_model_name=args.served_model_name,
                               api_key=args.api_key, chat_template=config.model.chat_template)
    start_on_ray_serve(settings, args.host, http_port)
    return f"http://{args.host}:{args.port}"


def wait_until_healthy(http_url: str, timeout_s: float, stopping: Callable[[], bool] = lambda: False) -> None:
    """Until the gateway's /health says 200 (it has heard from admission, a ready engine and a tokenizer:
    the first tokenizer heartbeat may come a second after the gateway starts), so that "up" means
    serving. Past `timeout_s` it says why not and goes on: the services are up, /health tells the rest."""
    import urllib.error
    import urllib.request

    deadline, reason = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline and not stopping():
        try:
            with urllib.request.urlopen(f"{http_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            reason = exc.read().decode(errors="replace")[:300]
        except (urllib.error.URLError, OSError) as exc:
            reason = str(exc)
        time.sleep(0.1)
    if not stopping():
        print(f"  /health is not 200 yet after {timeout_s:.0f} s: {reason}", flush=True)


def _stop_gateway(timeout_s: float, cluster: RayCluster) -> None:
    """Let the gateway finish the HTTP responses it is writing (for up to `timeout_s`), then stop Serve.
    Until then it stays up and answers new requests with the tokenizer's 503 refusal. On a local Ray
    (`cluster.owned`) Serve goes with the cluster at `ray.shutdown`: `serve.shutdown` would only add
    3 s and Ray's "graceful_shutdown failed ... will be retried" lines to every stop."""
    from ray import serve

    if cluster.gone:
        return  # the gateway died with it
    try:
        gateway = serve.get_app_handle("orca-gateway")
        deadline = time.monotonic() + timeout_s
        while gateway.open_requests.remote().result(timeout_s=5) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(GATEWAY_FLUSH_S)
    except Exception as exc:  # noqa: BLE001 - best effort; Serve stops either way
        log.warning("could not wait for the gateway's open requests: %s", exc)
    if cluster.owned:
        return
    try:
        serve.shutdown()
    except Exception:  # noqa: BLE001 - best effort; ray.shutdown follows
        pass


def _drain(tokenizer: SupervisedProcess, jobs: SupervisedProcess, timeout_s: float, at_once: bool = False) -> None:
    """SIGTERM the services that take requests in: they finish what they hold within `timeout_s`,
    while everything behind them (admission, engines, NATS) still runs. The jobs service then exits;
    the tokenizer says "drained" on its pipe and keeps refusing new requests (a clear "shutting
    down", not NATS' "no responders") until `stop_processes` stops it, after the gateway and engines.
    Nothing is restarted from here on. `at_once` (the engines are gone: nothing in flight can finish)
    sends each a second SIGTERM, which ends what they hold now (requests with the "shutting down"
    error, jobs back to JetStream)."""
    for service in (tokenizer, jobs):
        service.signal(signal.SIGTERM)
    if at_once:
        time.sleep(0.2)  # two SIGTERMs sent together may reach a process as one
        for service in (tokenizer, jobs):
            service.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s + 10  # their own deadline, plus time to say so
    if tokenizer.process.poll() is None and tokenizer.drained_read is not None:
        readable, _, _ = select.select([tokenizer.drained_read], [], [], timeout_s + 10)
        if not readable:
            log.warning("the tokenizer did not finish draining in %.0f s", timeout_s + 10)
    try:
        jobs.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        jobs.process.kill()
        jobs.process.wait()


def _stop_masters(masters: list, cluster: RayCluster) -> None:
    import ray

    if cluster.gone:
        return  # they died with it
    try:
        ray.get([m.stop.remote() for m in masters], timeout=10)
    except Exception:  # noqa: BLE001 - best effort; ray.shutdown follows
        pass


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serve")
    g.add_argument("--nats-url", default=env.nats_url_default(), help="use this NATS instead of starting one")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    g.add_argument("--cpu-bind", choices=("auto", "off"), default="auto",
                   help="auto: on a CPU-only local Ray, each worker runs on cores of its own (the last ones) and "
                        "everything else on the rest (a lone worker borrows them for a prompt that comes while "
                        "nothing decodes); off: the OS places them")
    add_serve_flags(g)
    g.add_argument("--log-level", default="INFO")
    g.add_argument("--host", default="127.0.0.1", help="HTTP (OpenAI-compatible API) listen address")
    g.add_argument("--port", type=port_number, default=8000, help="HTTP port (0: any free port)")
    g.add_argument("--api-key", default=env.api_key(),
                   help="require 'Authorization: Bearer <key>' on the HTTP API (default: $ORCA_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name of the HTTP API (default: --model)")


def resolve_model(args: argparse.Namespace) -> None:
    if args.model is None:
        args.model = ensure_demo_model()
    elif not Path(args.model).expanduser().is_dir():
        raise ValueError(f"--model {args.model} is not a directory")
