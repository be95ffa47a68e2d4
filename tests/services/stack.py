"""Run `orca serve` as a user would (a subprocess) and talk to it over real NATS."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import nats

from services import cpu_binding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class OrcaServe:
    def __init__(self, args: list[str], timeout_s: float = 300.0) -> None:
        self.log: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", *args], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while not any("orca-serve is up" in line for line in self.log):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("orca serve did not come up:\n" + "".join(self.log[-60:]))
            time.sleep(0.2)
        up = next(line for line in self.log if "orca-serve is up" in line)
        self.nats_url = re.search(r"nats://[\d.]+:\d+", up).group(0)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


async def stream(nc, body: dict | bytes, timeout_s: float = 120.0,
                 on_event: Callable[[dict], None] | None = None) -> list[dict]:
    """Send one generate request; return every event up to and including the final one."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    await nc.publish("orca.v1.generate", data, reply=inbox)
    events = []
    try:
        while True:
            event = json.loads((await sub.next_msg(timeout=timeout_s)).data)
            events.append(event)
            if on_event:
                on_event(event)
            if event["finish_reason"] is not None:
                return events
    finally:
        await sub.unsubscribe()


async def kill_while_streaming(nats_url: str, bodies: list[dict], pid: int, started_within_s: float,
                               timeout_s: float = 120.0) -> list[list[dict]]:
    """Stream `bodies`, SIGKILL `pid` as soon as the first event of any arrives, and return each
    request's events up to its final one."""
    nc = await nats.connect(nats_url)
    started = asyncio.Event()
    tasks = [asyncio.create_task(stream(nc, b, timeout_s=timeout_s, on_event=lambda e: started.set())) for b in bodies]
    await asyncio.wait_for(started.wait(), started_within_s)
    os.kill(pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    await nc.close()
    return results


async def engine_statuses(nats_url: str, seconds: float = 1.5) -> dict[str, object]:
    """The latest status of each engine replica, heard over `seconds` (the heartbeats and the statuses
    between them, which only admission reads)."""
    from shared.codec import Codec
    from shared.messages import EngineStatus

    codec = Codec(EngineStatus)
    latest: dict[str, EngineStatus] = {}
    nc = await nats.connect(nats_url)

    async def on_status(msg) -> None:
        status = codec.decode(msg.data)
        latest[status.replica] = status

    for subject in ("orca.v1.engine.status", "orca.v1.engine.progress"):
        await nc.subscribe(subject, cb=on_status)
    await asyncio.sleep(seconds)
    await nc.close()
    return latest


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid` still running, read from /proc."""
    found = []
    for child in sorted(cpu_binding.descendants(pid)):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found.append((child, f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:
            continue  # ended meanwhile
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed child of a process that has exited waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"


def worker_pids(serve: OrcaServe) -> list[int]:
    return [pid for pid, cmd in descendants(serve.process.pid) if cmd.startswith("ray::Worker")]
