"""python -m services.jobs --nats-url nats://..."""

from __future__ import annotations

import argparse
import asyncio

from services import liveness
from services.bus import run_service
from services.jobs.service import JobsService
from services.logs import setup_logging


async def main(args: argparse.Namespace) -> None:
    async def start(nc):
        liveness.start(args.alive_file)
        service = JobsService(nc, args.concurrency)
        await service.start()
        return lambda: service.stop(args.drain_timeout)

    await run_service("orca-jobs", args.nats_url, start)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.jobs")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--concurrency", type=int, default=64, help="jobs generated at once")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let jobs in progress finish (the rest are redelivered later)")
    parser.add_argument("--alive-file", default=None,
                        help="touch this file every second while the event loop runs (for a supervisor's liveness check)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    setup_logging(args.log_level)
    asyncio.run(main(args))
