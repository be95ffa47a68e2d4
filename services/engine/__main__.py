"""python -m services.engine --nats-url nats://... --model DIR [--ray-address auto]

Starts one engine replica (master + workers as Ray actors) on an existing or local Ray and
keeps it up until SIGTERM, as the docker-compose stack runs it: a master that dies or hangs is
restarted (services/engine/launch.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from services.cli import add_engine_args, engine_config_from_args
from services.logs import setup_logging
from services.service_args import add_service_args


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m services.engine")
    add_engine_args(parser)
    add_service_args(parser, alive_file="every half second while supervising")
    parser.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    parser.add_argument("--replica", default="0", help="this replica's name (unique per engine)")
    parser.add_argument("--worker-threads", type=int, default=None)
    parser.add_argument("--step-timeout", type=float, default=120.0,
                        help="an iteration with no result within this many seconds counts as a dead worker")
    parser.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs reserved per worker")
    parser.add_argument("--hang-timeout", type=float, default=10.0,
                        help="a master that answers nothing this many seconds is killed and restarted")
    args = parser.parse_args()
    setup_logging(args.log_level)

    import ray

    from services.engine.launch import MasterSupervisor, WorkerLaunch, launch_master

    config = engine_config_from_args(args)
    os.environ.setdefault("RAY_worker_niceness", "0")  # see services/serve.py
    ray.init(address=args.ray_address, include_dashboard=False, configure_logging=False)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    launch = WorkerLaunch(step_timeout_s=args.step_timeout, worker_cpus=args.worker_cpus,
                          worker_threads=args.worker_threads)
    master = launch_master(config, args.nats_url, args.replica, launch)
    supervisor = MasterSupervisor(args.replica, master, hang_timeout_s=args.hang_timeout).start(time.monotonic())
    print(f"engine replica {args.replica} starting on {args.nats_url}", file=sys.stderr, flush=True)
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
