"""A service process's proof of life, for whoever supervises it (`orca serve`, a Kubernetes
liveness probe, a compose healthcheck): a file that its event loop touches every second.

A process that died stops touching it, and so does one that hangs: a SIGSTOPped process, or a
loop blocked by a call that never returns; a supervisor restarts a process whose file is too old.
The file says nothing about NATS on purpose: a service that waits for NATS to come back is
healthy (it reconnects by itself), and restarting it then would only lose its requests.

    python -m services.liveness /tmp/orca-alive 15    # exit 0 if touched within 15 s (the probe)
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

TOUCH_EVERY_S = 1.0
_tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly


def start(path: str | None) -> asyncio.Task | None:
    """Touch `path` every TOUCH_EVERY_S from the running loop, until the task is cancelled."""
    if not path:
        return None
    task = asyncio.get_running_loop().create_task(_touch_forever(Path(path)))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def _touch_forever(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        path.touch()
        await asyncio.sleep(TOUCH_EVERY_S)


def age_s(path: str, now: float | None = None) -> float | None:
    """Seconds since `path` was last touched (wall clock, as file times are), or None if absent."""
    try:
        touched = os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    return (time.time() if now is None else now) - touched


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m services.liveness FILE MAX_AGE_S", file=sys.stderr)
        return 2
    age = age_s(argv[0])
    if age is None or age > float(argv[1]):
        print(f"{argv[0]}: {'absent' if age is None else f'{age:.0f} s old'}: the service is dead or hung",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
