"""NATS connection and service lifecycle, as in nats.py's examples: one connection per
service, reconnect forever, SIGTERM/SIGINT set an event, drain on the way out."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client

log = logging.getLogger("orca.bus")

REQUEST_TIMEOUT_S = 5.0
MAX_PAYLOAD_HINT = 1024 * 1024  # nats-server's default max_payload


async def connect(url: str, name: str) -> Client:
    async def on_error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    async def on_disconnect() -> None:
        log.warning("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to NATS", name)

    return await nats.connect(
        url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5,
        error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
        pending_size=64 * 1024 * 1024,
    )


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (services stop gracefully on either)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (e.g. inside Ray)
            pass
    return stop


async def run_service(name: str, url: str, start: Callable[[Client], Awaitable[Callable[[], Awaitable[None]] | None]],
                      stop: asyncio.Event | None = None) -> None:
    """Connect, let `start` subscribe (it may return a coroutine function that stops its own
    tasks), wait for a stop signal, then stop those tasks and drain."""
    stop = stop or stop_event_on_signals()
    nc = await connect(url, name)
    cleanup = None
    try:
        cleanup = await start(nc)
        log.info("%s: ready on %s", name, url)
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
