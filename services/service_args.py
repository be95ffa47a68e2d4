"""The flags every service process (`python -m services.<name>`) takes, declared once."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import signal
import sys
import traceback
from collections.abc import Coroutine
from typing import Any, NoReturn

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


def run_event_loop(main: Coroutine[Any, Any, None]) -> NoReturn:
    """Run a service's main coroutine, then exit at once, skipping the interpreter's teardown.

    On uvloop where it is installed (it is on Linux), else on asyncio's own loop. A message through a
    service is a few loop turns (read, callback, writer task, flush); uvloop's are cheaper: the
    tokenizer's engine-output-in to event-out took 0.55 ms at the median against 0.75 on asyncio's
    loop (single stream, the 2-core VM).

    The exit: the exit handlers run (log handlers, the telemetry exporters' last flush), then
    `os._exit`. The interpreter's final garbage collection is skipped because it can spin: the jobs
    service, stopped after the Ray cluster beside it had died (a SIGTERM to `orca serve`'s whole
    process group), ran at 100% CPU inside `Py_FinalizeEx` -> `gc_collect_main` until `orca serve`
    killed it 40 s later (seen with gdb; a stop without Ray dying never did it)."""
    code = 0
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main)
        else:
            uvloop.run(main)
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - said on stderr, as Python itself would, then exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def exit_code(exc: SystemExit) -> int:
    """The status a SystemExit asks for, as the interpreter would turn it into one."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1
