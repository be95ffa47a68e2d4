"""Run `orca serve` (and the gateway alone) for the gateway tests, and read server-sent events."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.services.stack import ROOT, OrcaServe


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GatewayServe(OrcaServe):
    """`orca serve` on any free HTTP port (`--port 0`); `http_url` parsed from its "orca-serve is up" line."""

    def __init__(self, args: list[str], timeout_s: float = 300.0) -> None:
        super().__init__([*args, "--port", "0"], timeout_s)
        up = next(line for line in self.log if "orca-serve is up" in line)
        self.http_url = re.search(r"http://[\d.]+:\d+", up).group(0)


class GatewayProcess:
    """`python -m services.gateway` (uvicorn, no Ray) against an existing NATS."""

    def __init__(self, nats_url: str, model: str, *args: str, env: dict[str, str] | None = None,
                 timeout_s: float = 120.0) -> None:
        port = free_port()
        self.http_url = f"http://127.0.0.1:{port}"
        self.log: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--nats-url", nats_url, "--model", model, "--port", str(port),
             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})})
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.http_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the gateway did not come up:\n" + "".join(self.log[-40:]))
            time.sleep(0.2)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def sse_events(raw: bytes) -> list[dict | str]:
    """Split an SSE body into its events, checking the framing: every event is one `data: ` line
    followed by a blank line; JSON payloads decoded, `[DONE]` kept as the string."""
    text = raw.decode()
    assert text.endswith("\n\n"), repr(text[-40:])
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, repr(block)
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
