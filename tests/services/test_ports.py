"""The HTTP port `orca serve` picks stays its own until the gateway listens on it."""

from __future__ import annotations

import socket

import pytest

from services.ports import PortReservation


def plain_bind(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def reuse_port_listener(port: int) -> socket.socket:
    """What Serve's replica (with rebindable_direct_ingress) and its proxy bind."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_port_zero_picks_a_port_that_no_one_else_can_bind_while_reserved():
    with PortReservation("127.0.0.1", 0) as reservation:
        assert reservation.port > 0
        with pytest.raises(OSError):
            plain_bind(reservation.port)
    plain_bind(reservation.port)  # released


def test_a_reuse_port_listener_shares_it_and_gets_every_connection():
    with PortReservation("127.0.0.1", 0) as reservation:
        listener = reuse_port_listener(reservation.port)
        with listener:
            for _ in range(20):  # the reservation never listens, so it never takes a connection
                with socket.create_connection(("127.0.0.1", reservation.port), timeout=2):
                    accepted, _ = listener.accept()
                    accepted.close()


def plain_listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("listener", [plain_listener, lambda: reuse_port_listener(0)],
                         ids=["plain listener", "another orca serve's gateway (SO_REUSEPORT)"])
def test_a_port_someone_listens_on_is_refused_at_once_with_the_reason(listener):
    with listener() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen there"):
            PortReservation("127.0.0.1", port)


def test_release_is_idempotent():
    reservation = PortReservation("127.0.0.1", 0)
    reservation.release()
    reservation.release()
    plain_bind(reservation.port)


def test_a_port_a_stopped_server_just_left_can_be_taken_again_at_once():
    """Restarting `orca serve` on the same --port right after stopping it: the old server's side of
    its connections sits in TIME_WAIT for a minute, which must not refuse the port."""
    listener = reuse_port_listener(0)  # the gateway's (and uvicorn's) listener sets SO_REUSEADDR
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server closes first: its end goes to TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    with pytest.raises(OSError):
        plain_bind(port)  # what a bind without SO_REUSEADDR meets
    with PortReservation("127.0.0.1", port) as reservation:
        assert reservation.port == port
