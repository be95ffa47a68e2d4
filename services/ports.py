"""Hold an HTTP port from the moment `orca serve` picks it until Ray Serve listens on it.

`orca serve` chooses its port before it starts anything, and the gateway replica binds it tens of
seconds later. A port merely found free in between is anybody's: another process's bind(0) or an
outgoing connection can take it, and the replica then fails to bind (Serve reports only "failed to
update the deployments"). A reservation keeps the port bound, never listening, with SO_REUSEADDR
and SO_REUSEPORT: the kernel gives it to no one else, except a listener of the same user that binds
with SO_REUSEPORT as well, which is what Serve's replica (with `rebindable_direct_ingress`) and its
proxy do. Incoming connections go to listening sockets only, so the reservation never takes one.
"""

from __future__ import annotations

import argparse
import socket


def port_number(text: str) -> int:
    """argparse type of a TCP port flag: 0 (any free port) to 65535, or a usage error that says so."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535; 0: any free port)")
    return port


class PortReservation:
    """host:port, held until `release()`. Use `port` for the number (the one chosen for port 0)."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:  # no listener now, not even a reuse-port peer's
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a stopped server's TIME_WAITs are no owner
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
            self.port: int = probe.getsockname()[1]
        self._socket: socket.socket | None = socket.socket(family)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._socket.bind((host, self.port))
        except OSError as exc:  # taken in the microseconds since the probe closed
            self._socket.close()
            raise ValueError(f"--host {host} --port {self.port}: cannot listen there ({exc.strerror})") from None

    def release(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
