"""NATS connection and service lifecycle, as in nats.py's examples: one connection per
service, reconnect forever, SIGTERM/SIGINT set an event, drain on the way out.

A NATS URL here (`--nats-url`, ORCA_NATS_URL) may name a cluster: a comma-separated list,
`nats://a:4222,nats://b:4222,nats://c:4222`. A service connects to one of them and moves to
another when that one goes away (nats.py also learns the cluster's other servers from the one it
is on). Credentials belong to the list, not to one server: every server, the ones learnt too, is
given the same ones."""

from __future__ import annotations

import asyncio
import logging
import signal
import weakref
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit, urlunsplit

import nats
from nats.aio.client import Client

from shared import env, subjects

log = logging.getLogger("orca.bus")

REQUEST_TIMEOUT_S = 5.0
MAX_PAYLOAD_HINT = 1024 * 1024  # nats-server's default max_payload
SCHEMES = ("nats", "tls", "ws", "wss")

class Bus(Protocol):
    """What the services use of their NATS connection, and all they may use: nats.py's `Client` (made by
    `connect`) is the real one; tests/fake_nats.py's RecordingNats the in-memory one for the tests of a
    service's logic. Reconnects reach a service through `on_reconnect`."""

    @property
    def is_connected(self) -> bool: ...

    def new_inbox(self) -> str: ...

    async def subscribe(self, subject: str, queue: str = "", cb: Callable[[Any], Awaitable[None]] | None = None,
                        **options: Any) -> Any: ...

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None: ...

    async def flush(self, timeout: float = ...) -> None: ...


_reconnect_listeners: weakref.WeakKeyDictionary[Bus, list[Callable[[], None]]] = weakref.WeakKeyDictionary()


def on_reconnect(nc: Bus, callback: Callable[[], None]) -> None:
    """Call `callback` after each reconnect of `nc` (a connection made by `connect`). Core NATS
    keeps nothing for a subscriber that is away, so messages may have been lost meanwhile. The
    callback runs inside nats.py's reconnect: it must not block (start a task for real work)."""
    _reconnect_listeners.setdefault(nc, []).append(callback)


def _is_refusal(exc: Exception) -> bool:
    # nats.py raises a plain Error with the server's text while connecting, AuthorizationError once connected
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


_abandoning: set[asyncio.Future] = set()
"""Connect attempts being stopped after their caller was cancelled (held here so they are not collected)."""


class CredentialsRefused(ConnectionError):
    """A NATS server refused a service's credentials (or their absence) on its first connect."""


async def connect(url: str, name: str) -> Client:
    """Connect to the server, or one of the servers, `url` names (see the module docstring). A server
    that does not answer is waited for; one that refuses the credentials on the first connect raises
    CredentialsRefused (a cluster's servers share their accounts: waiting would never end). Once connected,
    a refusal on a reconnect (a server back with other accounts) is logged and tried again, as any failed
    reconnect is, to keep the requests in flight."""
    said: dict[str, float] = {}
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    credentials = auth_options(url)

    async def on_error(exc: Exception) -> None:
        if not refused.done() and _is_refusal(exc):
            refused.set_result(exc)
        # a server that is not there fails every reconnect attempt (twice a second): say it once a minute
        now, text = time.monotonic(), str(exc)
        if now - said.get(text, -60.0) >= 60.0:
            said[text] = now
            log.warning("%s: NATS error: %s", name, text)

    async def on_disconnect() -> None:
        if nc.is_closed:  # closed on purpose (nats.py calls this on close too): nothing is wrong
            log.debug("%s: closed its NATS connection", name)
        else:
            log.warning("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        log.info("%s: reconnected to NATS at %s", name, nc.connected_url.netloc if nc.connected_url else "?")
        for callback in _reconnect_listeners.get(nc, ()):
            callback()

    connecting = asyncio.ensure_future(nats.connect(
        servers=server_urls(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5,
        error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=reconnected,
        pending_size=64 * 1024 * 1024, **credentials,
    ))
    try:
        await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller gave up: finish stopping nats.py's attempts on our own
        _abandoning.add(task := asyncio.ensure_future(abandon_connect(connecting)))
        task.add_done_callback(_abandoning.discard)
        raise
    if not connecting.done():
        await abandon_connect(connecting)
        what = "refused the credentials of" if credentials else "wants credentials from"
        raise CredentialsRefused(
            f"NATS at {redact_url(url)} {what} {name} ({refused.result()}): give the user and password, or a "
            "token, in the URL (nats://user:password@host:port) or as ORCA_NATS_USER / ORCA_NATS_PASSWORD")
    refused.cancel()  # from here on a refusal is one more failed reconnect
    nc = connecting.result()
    return nc


@dataclass(frozen=True)
class Credentials:
    """What a NATS URL's user part says: a user and password, or a lone token."""

    user: str | None = None
    password: str | None = None
    token: str | None = None


def split_urls(url: str) -> list[SplitResult]:
    """The URLs of a comma-separated list (one URL is a list of one); a ValueError names an empty
    list or entry, or one that is not a URL with a host."""
    entries = [u.strip() for u in url.split(",")]
    if not any(entries):
        raise ValueError(f"NATS URL {url!r}: no server")
    parts = []
    for entry in entries:
        if not entry:
            raise ValueError(f"NATS URL list {redact_url(url)!r}: an empty entry")
        part = urlsplit(entry if "://" in entry else f"nats://{entry}")
        try:
            part.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise ValueError(f"NATS URL {redact_url(entry)!r}: the port is not a number") from None
        if part.scheme not in SCHEMES or not part.hostname:
            raise ValueError(f"NATS URL {redact_url(entry)!r}: want nats://host:port")
        parts.append(part)
    return parts


def server_urls(url: str) -> list[str]:
    """The servers of `url` without their credentials (auth_options carries those), for
    nats.connect's `servers`."""
    out = []
    for part in split_urls(url):
        host = f"[{part.hostname}]" if ":" in part.hostname else part.hostname
        netloc = host if part.port is None else f"{host}:{part.port}"
        out.append(urlunsplit(part._replace(netloc=netloc)))
    return out


def url_credentials(url: str) -> Credentials | None:
    """The credentials the URLs carry, or None if none does. Servers without any take those of the
    others; two servers naming different ones are a ValueError (one connection has one user)."""
    found = {_credentials(part) for part in split_urls(url)} - {None}
    if len(found) > 1:
        raise ValueError(f"NATS URL list {redact_url(url)!r}: the servers name different credentials")
    return next(iter(found), None)


def _credentials(part: SplitResult) -> Credentials | None:
    if part.username is None:
        return None
    if part.password is None:
        return Credentials(token=part.username)  # a lone username is a token
    return Credentials(user=part.username, password=part.password)


def auth_options(url: str) -> dict[str, str]:
    """nats.connect's credentials for the server or servers `url` names: the ones the URLs carry,
    else ORCA_NATS_USER / ORCA_NATS_PASSWORD; and the user's own inbox prefix, so replies to a
    service arrive where only its user may subscribe (deploy/nats/nats.conf). Given as options,
    they reach the cluster's servers that nats.py learns on the way too (those come without any)."""
    options: dict[str, str] = {}
    credentials = url_credentials(url)
    if credentials is None and (from_env := env.nats_credentials()) is not None:
        credentials = Credentials(*from_env)
    if credentials is not None and credentials.token is not None:
        options["token"] = credentials.token
    elif credentials is not None:
        options["user"], options["password"] = credentials.user, credentials.password
        if subjects.is_valid_token(credentials.user):
            options["inbox_prefix"] = f"_INBOX_{credentials.user}"
    return options


def redact_url(url: str) -> str:
    """The URL, or each URL of a list, without its secret (a password, or a token in the user
    part), for logs."""
    return ",".join(_redact(entry.strip()) for entry in url.split(","))


def _redact(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")  # `user:pw@host` is not a scheme
    if parts.username is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    userinfo = f"{parts.username}:***" if parts.password is not None else "***"
    netloc = f"{userinfo}@{host}"
    try:
        port = parts.port
    except ValueError:  # not a number: leave it out rather than fail a log line
        port = None
    if port is not None:
        netloc += f":{port}"
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


async def synced(nc: Client, timeout_s: float = 5.0) -> None:
    """Return once the server has processed everything sent on `nc` so far (its subscriptions are
    live). nats.py's `flush()` alone does not promise it: it writes its PING straight to the socket,
    ahead of the SUBs and PUBs still in the pending buffer, so its PONG can come before the server
    has seen them (a message published from another connection right after was then lost, about 1
    in 150 fresh connections: tests/deploy/test_nats_auth.py). Writing the buffer out first closes
    that gap (`_flush_pending` is nats.py's own; there is no public call that does it)."""
    await nc._flush_pending(force_flush=True)
    await nc.flush(timeout=timeout_s)


async def sent(nc: Client) -> None:
    """Write everything published on `nc` so far to the socket now. nats.py leaves a publish in its
    pending buffer for a flusher task, which runs only once the caller yields to the event loop: a
    caller about to block it (a worker starting its next step) would hold the message back that long."""
    await nc._flush_pending(force_flush=True)


async def run_service(name: str, url: str, start: Callable[[Client], Awaitable[Callable[[], Awaitable[None]] | None]],
                      stop: asyncio.Event | None = None) -> None:
    """Connect, let `start` subscribe (it may return a coroutine function that stops its own
    tasks), wait for a stop signal, then stop those tasks and drain. A stop signal while NATS does not
    answer yet ends it at once (connecting waits for the server for ever)."""
    stop = stop or stop_event_on_signals()
    try:
        nc = await connect_unless_stopped(url, name, stop)
    except CredentialsRefused as exc:
        raise SystemExit(str(exc)) from None  # one line and status 1: no retry can fix it
    if nc is None:
        log.info("%s: stopped before NATS at %s answered", name, redact_url(url))
        return
    cleanup = None
    try:
        cleanup = await start(nc)
        await synced(nc)
        log.info("%s: ready on %s", name, redact_url(url))
        await stop.wait()
    finally:
        if cleanup is not None:
            await cleanup()
        await drain_quietly(nc)


async def connect_unless_stopped(url: str, name: str, stop: asyncio.Event) -> Client | None:
    """`connect`, or None once `stop` is set first (a signal while the server does not answer)."""
    connecting, stopped = asyncio.ensure_future(connect(url, name)), asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if connecting.done():
        return connecting.result()
    await abandon_connect(connecting)
    return None


async def abandon_connect(connecting: asyncio.Future) -> None:
    """Stop a `connect` still retrying. Cancelled again until it ends: in Python 3.11 the `wait_for` inside
    nats.py's connect swallows a cancellation that lands as a refused attempt ends (it raises the refusal
    instead), and nats.py, taking that for one more failed attempt, retries for ever; a waiter hung with it
    (seen under load in a test). A connection made meanwhile is closed."""
    while not connecting.done():
        connecting.cancel()
        await asyncio.wait({connecting}, timeout=0.2)
    if not connecting.cancelled() and connecting.exception() is None:
        await drain_quietly(connecting.result())


async def drain_quietly(nc: Client) -> None:
    """Drain, or just close when the server is already gone (shutdown order is not ours to pick)."""
    try:
        await nc.drain()
    except Exception as exc:  # noqa: BLE001
        log.info("drain failed (%s); closing", exc)
        await nc.close()
