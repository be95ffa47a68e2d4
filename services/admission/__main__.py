"""python -m services.admission --nats-url nats://..."""

from __future__ import annotations

import argparse

from services.admission.service import AdmissionService
from services import liveness, parent_watch
from services.bus import run_service
from services.logs import setup_logging
from services.service_args import add_service_args, run_event_loop
from shared.flags import add_serve_flags


async def main(args: argparse.Namespace) -> None:
    parent_watch.start(args.parent_pid)  # first: it must work while NATS is unreachable too
    async def start(nc):
        liveness.start(args.alive_file)
        service = AdmissionService(nc, args.max_queue_len, args.no_engine_timeout)
        await service.start()
        return service.stop

    await run_service("orca-admission", args.nats_url, start)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.admission")
    add_service_args(parser)
    add_serve_flags(parser, ["max_queue_len"])
    parser.add_argument("--no-engine-timeout", type=float, default=60.0,
                        help="queued requests end with an error once no engine has been alive for this many seconds")
    args = parser.parse_args()
    setup_logging(args.log_level)
    run_event_loop(main(args))
