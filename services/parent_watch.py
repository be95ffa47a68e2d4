"""A supervised service stops when its supervisor is gone.

`orca serve` starts the tokenizer, admission and jobs processes in sessions of their own (so that a
terminal's Ctrl-C reaches only `orca serve`, which stops them in order). If `orca serve` itself is
killed (kill -9, the OOM killer) nobody stops them, and Ray's actors, which they serve, die with it.
So each polls for its parent: once the process that started it (`--parent-pid`) is no longer its
parent, it stops as on SIGTERM, and exits at once if that has not ended it within ORPHAN_EXIT_S
(a service still waiting for a NATS server that died too, say).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger("orca.supervision")

POLL_S = 1.0
ORPHAN_EXIT_S = 60.0
"""Longer than a drain (30 s by default) takes."""
_tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly


def start(parent_pid: int | None) -> asyncio.Task | None:
    """Watch for `parent_pid` to stop being this process's parent, from the running loop."""
    if parent_pid is None:
        return None
    task = asyncio.get_running_loop().create_task(_watch(parent_pid))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(POLL_S)
    log.warning("the supervisor (pid %d) is gone: stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(ORPHAN_EXIT_S)
    log.warning("still running %.0f s after the supervisor went: exiting", ORPHAN_EXIT_S)
    os._exit(1)
