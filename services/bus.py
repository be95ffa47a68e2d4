"""NATS connection and service lifecycle, as in nats.py's examples: one connection per
service, reconnect forever, SIGTERM/SIGINT set an event, drain on the way out."""

from __future__ import annotations

import asyncio
import logging
import signal
import weakref
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.aio.client import Client

from shared import env, subjects

log = logging.getLogger("orca.bus")

REQUEST_TIMEOUT_S = 5.0
MAX_PAYLOAD_HINT = 1024 * 1024  # nats-server's default max_payload

_reconnect_listeners: weakref.WeakKeyDictionary[Client, list[Callable[[], None]]] = weakref.WeakKeyDictionary()


def on_reconnect(nc: Client, callback: Callable[[], None]) -> None:
    """Call `callback` after each reconnect of `nc` (a connection made by `connect`). Core NATS
    keeps nothing for a subscriber that is away, so messages may have been lost meanwhile. The
    callback runs inside nats.py's reconnect: it must not block (start a task for real work)."""
    _reconnect_listeners.setdefault(nc, []).append(callback)


async def connect(url: str, name: str) -> Client:
    async def on_error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    async def on_disconnect() -> None:
        log.warning("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        log.info("%s: reconnected to NATS", name)
        for callback in _reconnect_listeners.get(nc, ()):
            callback()

    nc = await nats.connect(
        url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5,
        error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=reconnected,
        pending_size=64 * 1024 * 1024, **auth_options(url),
    )
    return nc


def auth_options(url: str) -> dict[str, str]:
    """Credentials from ORCA_NATS_USER / ORCA_NATS_PASSWORD unless the URL carries its own, and
    the user's own inbox prefix, so replies to a service arrive where only its user may
    subscribe (deploy/nats/nats.conf)."""
    parts = urlsplit(url)
    options: dict[str, str] = {}
    user = parts.username if parts.password is not None else None  # a lone username is a token
    credentials = env.nats_credentials()
    if parts.username is None and credentials is not None:
        user = credentials[0]
        options["user"], options["password"] = credentials
    if user and subjects.is_valid_token(user):
        options["inbox_prefix"] = f"_INBOX_{user}"
    return options


def redact_url(url: str) -> str:
    """The URL without its secret (a password, or a token in the user part), for logs."""
    parts = urlsplit(url)
    if parts.username is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    userinfo = f"{parts.username}:***" if parts.password is not None else "***"
    netloc = f"{userinfo}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (services stop gracefully on either)."""
    return stop_events_on_signals(1)[0]


def stop_events_on_signals(count: int) -> list[asyncio.Event]:
    """`count` events: the k-th SIGTERM or SIGINT sets the k-th (and every later signal the last),
    for a service whose first signal means "drain" and whose second means "now exit"."""
    events = [asyncio.Event() for _ in range(count)]

    def on_signal() -> None:
        next((e for e in events if not e.is_set()), events[-1]).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread (e.g. inside Ray)
            pass
    return events


async def run_service(name: str, url: str, start: Callable[[Client], Awaitable[Callable[[], Awaitable[None]] | None]],
                      stop: asyncio.Event | None = None) -> None:
    """Connect, let `start` subscribe (it may return a coroutine function that stops its own
    tasks), wait for a stop signal, then stop those tasks and drain."""
    stop = stop or stop_event_on_signals()
    nc = await connect(url, name)
    cleanup = None
    try:
        cleanup = await start(nc)
        log.info("%s: ready on %s", name, redact_url(url))
        await stop.wait()
    finally:
        if cleanup is not None:
            await cleanup()
        await drain_quietly(nc)


async def drain_quietly(nc: Client) -> None:
    """Drain, or just close when the server is already gone (shutdown order is not ours to pick)."""
    try:
        await nc.drain()
    except Exception as exc:  # noqa: BLE001
        log.info("drain failed (%s); closing", exc)
        await nc.close()
