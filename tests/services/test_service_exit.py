"""How a service process ends (`services.service_args.run_event_loop`): with the status its main
coroutine asks for, its exit handlers run (log handlers, telemetry's last flush), and without the
interpreter's teardown, whose final garbage collection was seen spinning for 40 s in the jobs service."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

SERVICE = textwrap.dedent("""
    import asyncio, atexit, sys
    from services.service_args import run_event_loop

    atexit.register(lambda: print("exit handlers ran", flush=True))

    async def main():
        await asyncio.sleep(0)
        {ending}

    run_event_loop(main())
    print("not reached")
""")


@pytest.mark.parametrize(("ending", "status", "stderr_has"), [
    ("return", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit('bad flag')", 1, "bad flag"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_a_service_exits_with_its_status_after_its_exit_handlers(ending, status, stderr_has):
    done = subprocess.run([sys.executable, "-c", SERVICE.format(ending=ending)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout == "exit handlers ran\n"
    assert stderr_has in done.stderr
