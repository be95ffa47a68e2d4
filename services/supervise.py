"""`orca serve`'s supervision of its service processes (tokenizer, admission, jobs): one that
exits is started again after a backoff, one that hangs (its liveness file, `services.liveness`,
grows old) is killed and started again, and the rest keep serving meanwhile. What each service
loses when it dies is recovered elsewhere: the clients resume a dead tokenizer's streams,
tokenizers resubmit what a dead admission had queued, JetStream redelivers a dead jobs
consumer's jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services import liveness

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Delay before the n-th restart in a row (the last one repeats)."""
STABLE_S = 60.0
"""A process that ran this long since its start begins the backoff from the first delay again."""
START_GRACE_S = 60.0
"""A process that has not touched its liveness file this long after starting is hung."""


@dataclass
class SupervisedProcess:
    """One service process, restarted when it dies or hangs. `command(extra)` is its command line;
    with `drained_pipe`, each start gets a fresh pipe whose write end it inherits (--drained-fd)."""

    name: str
    command: Callable[[list[str]], list[str]]
    alive_file: Path
    hang_timeout_s: float = 10.0
    drained_pipe: bool = False
    process: subprocess.Popen | None = None
    drained_read: int | None = None
    """The read end of the current process's drained pipe."""
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    events: list[str] = field(default_factory=list)

    def start(self, now: float) -> SupervisedProcess:
        extra = ["--alive-file", str(self.alive_file), "--parent-pid", str(os.getpid())]
        pass_fds: tuple[int, ...] = ()
        self.alive_file.unlink(missing_ok=True)
        if self.drained_pipe:
            self._close_pipe()
            self.drained_read, write = os.pipe()
            extra += ["--drained-fd", str(write)]
            pass_fds = (write,)
        # Own sessions: a terminal's Ctrl-C reaches only `orca serve`, which then stops them in order.
        self.process = subprocess.Popen(self.command(extra), start_new_session=True, pass_fds=pass_fds)
        for fd in pass_fds:
            os.close(fd)
        self.started_at, self.restart_at = now, None
        return self

    def check(self, now: float, wall_now: float) -> None:
        """Restart it if it exited (after the backoff) or kill it if it hangs (restarted next)."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self._note(f"restarting service {self.name}")
                self.start(now)
            return
        if self.process.poll() is not None:
            self.failures = 1 if now - self.started_at > STABLE_S else self.failures + 1
            delay = RESTART_BACKOFF_S[min(self.failures - 1, len(RESTART_BACKOFF_S) - 1)]
            self._note(f"service {self.name} exited with {self.process.returncode}; restarting it in {delay:.1f} s")
            self.restart_at = now + delay
            return
        if self.hung(now, wall_now):
            self._note(f"service {self.name} (pid {self.process.pid}) is hung: its liveness file is stale; killing it")
            self.process.kill()

    def hung(self, now: float, wall_now: float) -> bool:
        age = liveness.age_s(str(self.alive_file), wall_now)
        if age is None:
            return now - self.started_at > START_GRACE_S
        return age > self.hang_timeout_s

    def _note(self, event: str) -> None:
        print(f"orca: {event}", file=sys.stderr, flush=True)
        self.events.append(event)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def _close_pipe(self) -> None:
        if self.drained_read is not None:
            os.close(self.drained_read)
            self.drained_read = None

    def close(self) -> None:
        self._close_pipe()


def stop_processes(services: list[SupervisedProcess], timeout_s: float = 15.0) -> None:
    """SIGTERM every service, then wait for each (SIGKILL after `timeout_s`)."""
    for service in services:
        service.signal(signal.SIGTERM)
    for service in services:
        if service.process is not None:
            try:
                service.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()
        service.close()
