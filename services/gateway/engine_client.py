"""The gateway's side of NATS: publish generate requests, read their events, abort, and keep
the latest admission, engine and tokenizer status (`StatusBoard`: /health, back-pressure and the
context length). Streams whose tokenizer dies are resumed (`StreamWatch`, services/gateway/resume.py).

One connection per gateway process. Every request's reply subject is `<inbox>.<request id>`
under one wildcard subscription, and a `Generation` merges the events of the n requests one
HTTP call fans out to. Its writer (the HTTP response) takes everything that arrived since its last
write at once, merged per choice (`coalesce`): a busy writer sends several tokens per write, an idle
one gets each event as soon as it arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.gateway.metrics import MetricsBoard
from services.gateway.resume import StreamWatch
from services.gateway.status import StatusBoard
from services.bus import on_reconnect
from shared import subjects
from shared.api import AbortRequest, GenerateEvent, GenerateRequest, encode_json
from shared.codec import Codec
from shared.messages import AdmissionStatus, EngineStatus, TokenizerStatus
from shared.telemetry import trace_headers

log = logging.getLogger("orca.gateway")
admission_codec = Codec(AdmissionStatus)
engine_codec = Codec(EngineStatus)
tokenizer_codec = Codec(TokenizerStatus)

NO_TOKENIZER = "no tokenizer service is listening; retry later"


class Event(GenerateEvent, frozen=True, omit_defaults=True):
    """A GenerateEvent, plus per-token log-probabilities should the tokenizer service send them
    (shape of `orca generate`'s output: token_id, logprob, top_logprobs [{token_id, logprob}])."""

    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None


event_decoder = msgspec.json.Decoder(Event)


def coalesce(arrived: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
    """Events that arrived since the last write, merged per choice (first arrival first): a
    choice's tokens, text and logprobs in one event, ending as its last event ends. An error that
    ends a choice stays an event of its own, after the choice's text."""
    per_choice: dict[int, list[Event]] = {}
    for index, event in arrived:
        per_choice.setdefault(index, []).append(event)
    return [(index, merged) for index, events in per_choice.items() for merged in merge(events)]


def merge(events: list[Event]) -> list[Event]:
    last = events[-1]
    token_ids = [t for e in events for t in e.token_ids]
    text = "".join(e.text for e in events)
    logprobs = [lp for e in events for lp in e.logprobs or ()] or None
    if last.finish_reason == "error" and (token_ids or text):
        content = Event(last.id, token_ids, text, None, logprobs=logprobs)
        return [content, msgspec.structs.replace(last, token_ids=[], text="", logprobs=None)]
    if len(events) == 1:
        return events
    return [msgspec.structs.replace(last, token_ids=token_ids, text=text, logprobs=logprobs)]


class Generation:
    """The events of the requests one HTTP call made, merged: (choice index, event)."""

    def __init__(self, client: EngineClient, public_id: str, requests: list[GenerateRequest]) -> None:
        self.client = client
        self.public_id = public_id
        self.requests = requests
        self.arrived: list[tuple[int, Event]] = []
        """Events not taken yet, in arrival order."""
        self._wakeup = asyncio.Event()
        self.unfinished = {r.id for r in requests}
        self.done = asyncio.Event()
        """Set when every request has sent its last event (some may still wait in `arrived`)."""
        self.closed = False

    def deliver(self, index: int, event: Event) -> None:
        self.arrived.append((index, event))
        self._wakeup.set()
        if event.finish_reason is not None:
            self.unfinished.discard(self.requests[index].id)
            if not self.unfinished:
                self.done.set()

    @property
    def complete(self) -> bool:
        """Every event has been taken, the last ones included."""
        return not self.unfinished and not self.arrived

    async def take(self) -> list[tuple[int, Event]] | None:
        """Everything that arrived since the last take, merged per choice (`coalesce`); waits only
        while nothing has. None after the last event, or once the generation is closed."""
        if not await self._arrival():
            return None
        arrived, self.arrived = self.arrived, []
        return coalesce(arrived)

    async def next(self) -> tuple[int, Event] | None:
        """The next event of any of the requests (choice index, event), as it came; None after the
        last one, or once the generation is closed."""
        return self.arrived.pop(0) if await self._arrival() else None

    async def _arrival(self) -> bool:
        """Wait until there is an event to take; False when none will come or the generation closed."""
        while not self.arrived:
            if self.closed or not self.unfinished:
                return False
            self._wakeup.clear()
            await self._wakeup.wait()
        return not self.closed

    def abort(self) -> list[str]:
        """Abort every request of this call that has not finished (fire and forget: safe to call
        from a cancelled task); their last events then say "abort"."""
        ids = sorted(self.unfinished)
        self.client.abort_soon(ids)
        return ids

    def close(self) -> None:
        """Stop listening; whatever has not finished is aborted so its KV is freed."""
        if self.closed:
            return
        self.closed = True
        if self.unfinished:
            self.abort()
        self.client.forget(self)
        self._wakeup.set()  # wakes a reader still waiting


class EngineClient:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.status = StatusBoard()
        self.watch = StreamWatch(nc, self._give_up)
        self.metrics = MetricsBoard()
        self.inbox = nc.new_inbox()
        self.routes: dict[str, tuple[Generation, int]] = {}
        self.by_public_id: dict[str, Generation] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.nc.subscribe(subjects.ADMISSION_STATUS, cb=self._on_admission)
        await self.nc.subscribe(subjects.ENGINE_STATUS, cb=self._on_engine)
        await self.nc.subscribe(subjects.TOKENIZER_STATUS, cb=self._on_tokenizer)
        self._watching = asyncio.get_running_loop().create_task(self.watch.run())
        await self.nc.subscribe(subjects.METRICS, cb=self.metrics.on_message)
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_event)
        on_reconnect(self.nc, self._on_reconnected)

    def _on_reconnected(self) -> None:
        """Events sent here while NATS was away may be lost: every stream asks for a replay of what it
        lacks (the requests kept running in the engines meanwhile)."""
        self.watch.check_all_soon()

    async def wait_for_status(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.status.fresh_admission() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.status.fresh_admission() is not None

    async def submit(self, public_id: str, requests: list[GenerateRequest]) -> Generation:
        generation = Generation(self, public_id, requests)
        for index, request in enumerate(requests):
            self.routes[request.id] = (generation, index)
        self.by_public_id[public_id] = generation
        headers = trace_headers()  # the current HTTP span's traceparent: one trace through every service
        for request in requests:
            self.watch.watch(request, f"{self.inbox}.{request.id}")
            await self.nc.publish(subjects.GENERATE, encode_json(request), reply=f"{self.inbox}.{request.id}",
                                  headers=headers)
        return generation

    def forget(self, generation: Generation) -> None:
        for request in generation.requests:
            self.routes.pop(request.id, None)
            self.watch.forget(request.id)
        self.by_public_id.pop(generation.public_id, None)

    def abort_soon(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        task = asyncio.get_running_loop().create_task(self._abort(request_ids))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            for request_id in request_ids:
                await self.nc.publish(subjects.ABORT, encode_json(AbortRequest(request_id)))
            await self.nc.flush(timeout=5)
        except Exception as exc:  # noqa: BLE001 - NATS down: the engines cannot be told either
            log.warning("could not send aborts for %s: %s", request_ids, exc)

    @property
    def num_running(self) -> int:
        return sum(len(g.unfinished) for g in self.by_public_id.values())

    async def _on_event(self, msg: Msg) -> None:
        request_id = msg.subject[len(self.inbox) + 1:]
        route = self.routes.get(request_id)
        if route is None:
            return  # its HTTP call has gone
        if request_id not in route[0].unfinished:
            return  # it already ended (e.g. here, when NATS reconnected): one final event only
        if msg.headers and msg.headers.get("Status") == "503" and self.watch.resending(request_id):
            return  # no tokenizer took it yet (one restarts, or NATS just came back): the watch sends it again
        if msg.headers and msg.headers.get("Status") == "503":  # NATS: nobody subscribes to generate
            route[0].deliver(route[1], Event(request_id, [], "", "error", error=NO_TOKENIZER, retry=True))
            return
        try:
            event = event_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad event for %s: %s", request_id, exc)
            return
        if self.watch.take(request_id, event):
            route[0].deliver(route[1], event)

    def _give_up(self, request_id: str, error: str) -> None:
        route = self.routes.get(request_id)
        if route is not None and request_id in route[0].unfinished:
            route[0].deliver(route[1], Event(request_id, [], "", "error", error=error, retry=True))

    async def _on_admission(self, msg: Msg) -> None:
        try:
            self.status.on_admission(admission_codec.decode(msg.data))
        except msgspec.DecodeError as exc:
            log.warning("bad admission status: %s", exc)

    async def _on_engine(self, msg: Msg) -> None:
        try:
            self.status.on_engine(engine_codec.decode(msg.data))
        except msgspec.DecodeError as exc:
            log.warning("bad engine status: %s", exc)

    async def _on_tokenizer(self, msg: Msg) -> None:
        try:
            self.status.on_tokenizer(tokenizer_codec.decode(msg.data))
        except msgspec.DecodeError as exc:
            log.warning("bad tokenizer status: %s", exc)
