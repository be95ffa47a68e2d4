"""The gateway, as a NATS client, gets every stream whole: it outlives both a NATS outage and the
tokenizer that serves one of its streams (the client rule of the README, "When things fail").

Events are numbered (`seq`). The watch takes them only in order (core/streams.py): a repeat is
dropped, a gap asks the tokenizer for a replay from the first event missing
(`orca.v1.generate.replay`). A stream silent for SILENCE_S, and every stream after this gateway
reconnects to NATS, is asked for a replay the same way: the tokenizer holding it sends what this
gateway lacks (nothing, for a queued or prefilling request) and answers. When no tokenizer answers,
the one that held the stream is gone: the request is sent again, to the same reply subject, with
`resume_token_ids` (the tokens received) and `resume_seq`; another tokenizer (or the restarted one)
continues the stream from there, so the HTTP client sees one whole stream. While no tokenizer
listens at all (NATS answers 503), the resend is retried; after RESUME_DEADLINE_S of that the
stream ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from core.streams import Arrival, arrival
from shared.client import NoAnswer, ask
from shared import subjects
from shared.api import GenerateEvent, GenerateRequest, ReplayRequest, encode_json

log = logging.getLogger("orca.gateway")
SILENCE_S = 2.0
"""A stream silent this long is asked for a replay (a queued or prefilling request is silent too: its
tokenizer answers, with nothing to send again, and it is left alone)."""
PROBE_TIMEOUT_S = 1.0
RESUME_DEADLINE_S = 60.0
"""A stream whose tokenizer is gone, resent this long without any tokenizer taking it, ends."""
CHECK_EVERY_S = 0.5
MAX_PROBES = 32
"""Replay requests in flight at once (a dead tokenizer may leave many streams silent together)."""
NO_TOKENIZER_CAME_BACK = "the tokenizer serving this request died and none took it over within {:.0f} s; retry"


@dataclass
class Watched:
    request: GenerateRequest
    reply: str
    heard_at: float
    token_ids: list[int]
    next_seq: int = 0
    """The seq of the next event to take."""
    resending_since: float | None = None
    """When it was first resent (or first sent, until a tokenizer took it); None while a tokenizer
    is known to hold it."""


class StreamWatch:
    """`deliver_error(request_id, message)` ends a stream the gateway gives up on."""

    def __init__(self, nc: Client, deliver_error: Callable[[str, str], None]) -> None:
        self.nc = nc
        self.deliver_error = deliver_error
        self.watched: dict[str, Watched] = {}
        self._probes = asyncio.Semaphore(MAX_PROBES)
        self._busy: set[str] = set()

    def watch(self, request: GenerateRequest, reply: str) -> None:
        now = time.monotonic()
        self.watched[request.id] = Watched(request, reply, now, [], resending_since=now)

    def take(self, request_id: str, event: GenerateEvent) -> bool:
        """Whether to deliver `event`: the next of its stream (a repeat is not, and a gap asks for a
        replay at once)."""
        watched = self.watched.get(request_id)
        if watched is None:
            return True
        seen = arrival(watched.next_seq, event.seq)
        if seen is Arrival.REPEAT:
            return False
        if seen is Arrival.GAP:
            self.check_soon(request_id)
            return False
        watched.next_seq += 1
        if event.finish_reason is not None:
            del self.watched[request_id]
            return True
        watched.token_ids += event.token_ids
        watched.heard_at, watched.resending_since = time.monotonic(), None
        return True

    def forget(self, request_id: str) -> None:
        self.watched.pop(request_id, None)

    def resending(self, request_id: str) -> bool:
        """Whether a 503 ("no tokenizer listens") for this request answers a send no tokenizer has taken
        yet: then it is retried, not delivered as the stream's end."""
        watched = self.watched.get(request_id)
        return watched is not None and watched.resending_since is not None

    def check_all_soon(self) -> None:
        """After a reconnect: every stream may have missed events."""
        for request_id in list(self.watched):
            self.check_soon(request_id)

    def check_soon(self, request_id: str) -> None:
        if request_id in self.watched and request_id not in self._busy:
            self._busy.add(request_id)
            asyncio.get_running_loop().create_task(self._check(request_id, self.watched[request_id]))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            if not self.nc.is_connected:
                continue  # every stream is checked when NATS comes back (engine_client)
            now = time.monotonic()
            for request_id, watched in list(self.watched.items()):
                if now - watched.heard_at >= SILENCE_S:
                    self.check_soon(request_id)

    async def _check(self, request_id: str, watched: Watched) -> None:
        try:
            async with self._probes:
                held = await self._replayed(watched)
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

    async def _replayed(self, watched: Watched) -> bool:
        """Ask the tokenizer holding the request for its events from the first one not taken; whether
        one answered (the events come to the stream's subject before the answer)."""
        replay = ReplayRequest(watched.request.id, watched.next_seq)
        try:
            await ask(self.nc, subjects.GENERATE_REPLAY, encode_json(replay), PROBE_TIMEOUT_S)
        except NoAnswer:
            return False
        return True

    async def _resend(self, watched: Watched) -> None:
        log.warning("stream %s: no tokenizer holds it; resending it after %d tokens", watched.request.id,
                    len(watched.token_ids))
        resent = msgspec.structs.replace(watched.request, resume_token_ids=list(watched.token_ids),
                                         resume_seq=watched.next_seq)
        await self.nc.publish(subjects.GENERATE, encode_json(resent), reply=watched.reply)
