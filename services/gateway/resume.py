"""The gateway, as a NATS client, outlives the tokenizer that serves one of its streams.

A tokenizer owns a stream until its last event; if it dies (or hangs) the engine's tokens have
nowhere to go. So the gateway follows the client rule of the README ("When things fail"): a
stream silent for SILENCE_S is checked with `orca.v1.generate.held`; when no tokenizer says it
holds it, the request is sent again, to the same reply subject, with `resume_token_ids` = the
tokens this gateway has received. Another tokenizer (or the restarted one) continues the stream
from there, so the HTTP client sees one whole stream. A tokenizer that does still hold it only
takes the resend as a reattachment. While no tokenizer listens at all (NATS answers 503), the
resend is retried; after RESUME_DEADLINE_S of that the stream ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from shared import subjects
from shared.api import AbortRequest, GenerateEvent, GenerateRequest, encode_json

log = logging.getLogger("orca.gateway")
SILENCE_S = 2.0
"""A stream silent this long is checked (a queued or prefilling request is silent too: its
tokenizer answers that it holds it, and it is left alone)."""
PROBE_TIMEOUT_S = 1.0
RESUME_DEADLINE_S = 60.0
"""A stream whose tokenizer is gone, resent this long without any tokenizer taking it, ends."""
CHECK_EVERY_S = 0.5
MAX_PROBES = 32
"""Probes in flight at once (a dead tokenizer may leave many streams silent together)."""
NO_TOKENIZER_CAME_BACK = "the tokenizer serving this request died and none took it over within {:.0f} s; retry"


@dataclass
class Watched:
    request: GenerateRequest
    reply: str
    heard_at: float
    token_ids: list[int]
    resending_since: float | None = None
    """When it was first resent; None while a tokenizer is known to hold it."""


class StreamWatch:
    """`deliver_error(request_id, message)` ends a stream the gateway gives up on."""

    def __init__(self, nc: Client, deliver_error: Callable[[str, str], None]) -> None:
        self.nc = nc
        self.deliver_error = deliver_error
        self.watched: dict[str, Watched] = {}
        self._probes = asyncio.Semaphore(MAX_PROBES)
        self._busy: set[str] = set()

    def watch(self, request: GenerateRequest, reply: str) -> None:
        self.watched[request.id] = Watched(request, reply, time.monotonic(), [])

    def saw(self, request_id: str, event: GenerateEvent) -> None:
        watched = self.watched.get(request_id)
        if watched is None:
            return
        if event.finish_reason is not None:
            del self.watched[request_id]
            return
        watched.token_ids += event.token_ids
        watched.heard_at, watched.resending_since = time.monotonic(), None

    def forget(self, request_id: str) -> None:
        self.watched.pop(request_id, None)

    def resending(self, request_id: str) -> bool:
        """Whether a 503 ("no tokenizer listens") for this request answers a resend: then it is
        retried, not delivered as the stream's end."""
        watched = self.watched.get(request_id)
        return watched is not None and watched.resending_since is not None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            if not self.nc.is_connected:
                continue  # the gateway ends every stream itself when NATS comes back (engine_client)
            now = time.monotonic()
            for request_id, watched in list(self.watched.items()):
                if now - watched.heard_at >= SILENCE_S and request_id not in self._busy:
                    self._busy.add(request_id)
                    asyncio.get_running_loop().create_task(self._check(request_id, watched))

    async def _check(self, request_id: str, watched: Watched) -> None:
        try:
            async with self._probes:
                held = await self._held(request_id)
            if self.watched.get(request_id) is not watched:
                return  # it ended meanwhile
            now = time.monotonic()
            watched.heard_at = now  # next check after another SILENCE_S
            if held:
                watched.resending_since = None
                return
            watched.resending_since = watched.resending_since or now
            if now - watched.resending_since > RESUME_DEADLINE_S:
                del self.watched[request_id]
                self.deliver_error(request_id, NO_TOKENIZER_CAME_BACK.format(RESUME_DEADLINE_S))
                return
            await self._resend(watched)
        except Exception:  # noqa: BLE001 - NATS away: the next round tries again
            log.exception("could not check stream %s", request_id)
        finally:
            self._busy.discard(request_id)

    async def _held(self, request_id: str) -> bool:
        """Whether a tokenizer answers that it holds the request. On a reply subject of its own,
        not nats.py's `request`: that leaves a subscription behind for good at its first use."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(subjects.GENERATE_HELD, encode_json(AbortRequest(request_id)), reply=inbox)
            msg = await sub.next_msg(timeout=PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a timeout: nobody holds it
            return False
        finally:
            await sub.unsubscribe()
        return not (msg.headers and msg.headers.get("Status") == "503")  # "no responders": no tokenizer at all

    async def _resend(self, watched: Watched) -> None:
        log.warning("stream %s: no tokenizer holds it; resending it after %d tokens", watched.request.id,
                    len(watched.token_ids))
        resent = msgspec.structs.replace(watched.request, resume_token_ids=list(watched.token_ids))
        await self.nc.publish(subjects.GENERATE, encode_json(resent), reply=watched.reply)
