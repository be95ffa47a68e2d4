"""python -m services.jobs --nats-url nats://..."""

from __future__ import annotations

import argparse

from services import liveness, parent_watch
from services.bus import run_service, stop_events_on_signals
from services.jobs.service import JobsService, stream_configs
from services.logs import setup_logging
from services.service_args import add_service_args, run_event_loop
from shared import env
from shared.flags import add_serve_flags

REPLICAS_ENV = "ORCA_JETSTREAM_REPLICAS"
"""The default of --jetstream-replicas (compose and Kubernetes set it to 3 for their NATS clusters)."""


async def main(args: argparse.Namespace) -> None:
    parent_watch.start(args.parent_pid)  # first: it must work while NATS is unreachable too
    drain_signal, exit_signal = stop_events_on_signals(2)

    async def start(nc):
        liveness.start(args.alive_file)
        service = JobsService(nc, args.concurrency, args.jetstream_replicas, args.jobs_ack_wait)
        await service.start()
        return lambda: service.stop(args.drain_timeout, cut_short=exit_signal)  # a second signal: stop now

    await run_service("orca-jobs", args.nats_url, start, stop=drain_signal)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.jobs")
    add_service_args(parser)
    parser.add_argument("--concurrency", type=int, default=64, help="jobs generated at once")
    parser.add_argument("--jetstream-replicas", default=env.jetstream_replicas() or "1",
                        help="copies of the jobs streams: 3 on a NATS cluster of three servers or more, 1 on a "
                             f"single server (default: {REPLICAS_ENV}, else 1)")
    add_serve_flags(parser, ["drain_timeout", "jobs_ack_wait"])
    args = parser.parse_args(argv)
    try:
        args.jetstream_replicas = int(args.jetstream_replicas)
        stream_configs(args.jetstream_replicas)
    except ValueError as exc:
        parser.error(f"--jetstream-replicas / {REPLICAS_ENV} {args.jetstream_replicas!r}: {exc}")
    return args


if __name__ == "__main__":
    args = parse_args()
    setup_logging(args.log_level)
    run_event_loop(main(args))
