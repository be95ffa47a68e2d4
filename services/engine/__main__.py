"""python -m services.engine --nats-url nats://... --model DIR [--ray-address auto]

Starts one engine replica (master + workers as Ray actors) on an existing or local Ray and
keeps it up until SIGTERM, as the docker-compose stack runs it: a master that dies or hangs is
restarted (services/engine/launch.py).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

from services.cli import engine_config_from_args
from services.engine.launch import MasterSupervisor, WorkerLaunch, launch_master, replica_parser
from services.local_ray import apply_ray_settings
from services.logs import setup_logging
from shared.flags import serve_config_from_args


async def nats_answers(url: str) -> bool:
    """Wait for NATS, as every service does (False: a signal came first); CredentialsRefused when it refuses
    them, which would fail every start of the master after it."""
    from services.bus import connect_unless_stopped, drain_quietly, stop_event_on_signals

    nc = await connect_unless_stopped(url, "orca-engine-probe", stop_event_on_signals())
    if nc is None:
        return False
    await drain_quietly(nc)
    return True


def main() -> int:
    parser = replica_parser("python -m services.engine")
    args = parser.parse_args()
    setup_logging(args.log_level)
    try:
        settings = serve_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    from services.bus import CredentialsRefused, redact_url

    try:
        if not asyncio.run(nats_answers(args.nats_url)):
            return 0
    except CredentialsRefused as exc:
        print(exc, file=sys.stderr)
        return 1

    import ray

    config = engine_config_from_args(args)
    apply_ray_settings()
    ray.init(address=args.ray_address, include_dashboard=False, configure_logging=False)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    master = launch_master(config, args.nats_url, args.replica, WorkerLaunch.of(settings))
    supervisor = MasterSupervisor(args.replica, master, hang_timeout_s=settings.hang_timeout).start(time.monotonic())
    print(f"engine replica {args.replica} starting on {redact_url(args.nats_url)}", file=sys.stderr, flush=True)
    alive = Path(args.alive_file) if args.alive_file else None
    while not stop["now"]:
        supervisor.check(time.monotonic())  # restarts a master that died or hangs
        if alive is not None:
            alive.touch()
        time.sleep(0.5)
    ray.get(master.stop.remote(), timeout=10)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
