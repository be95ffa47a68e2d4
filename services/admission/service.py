"""Admission scheduler service: one global FCFS queue in front of every engine replica.

Requests come from tokenizers, engines report their room after every iteration, and the
pure `AdmissionQueue` decides who goes where. Requests it ends itself (aborted while queued,
queue full, impossible to serve, no engine alive for too long) get their final output sent back
to their tokenizer.

As it admits, it tells each owning tokenizer where its requests went (`Placed`): from then on the
tokenizer watches that engine's heartbeat and resumes the requests elsewhere if it goes. What is
still queued here is lost if this process dies; the tokenizers resubmit it when they see a status
with a new `incarnation`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nats.aio.msg import Msg

from core.admission import AdmissionQueue, QueueFull
from services.bus import Bus, on_reconnect
from services.admission.telemetry import AdmissionTelemetry
from shared import subjects
from shared.api import decode_abort
from shared.codec import Codec
from shared.messages import (Admit, AdmissionStatus, Cancel, EngineStatus, IterationOutputs, Placed,
                             TokenizedRequest)
from shared.outputs import FinishReason, RequestOutput
from shared.telemetry import SnapshotPublisher

log = logging.getLogger("orca.admission")
request_codec = Codec(TokenizedRequest)
status_codec = Codec(EngineStatus)
TICK_S = 0.25
"""How often engines' heartbeats are checked: a silent engine is dropped within expiry + this."""
ADMIT_RESEND_S = 1.0
"""An Admit no engine status has acknowledged for this long is sent again (an engine reports at least
every HEARTBEAT_S, and at once after an Admit)."""


class AdmissionService:
    def __init__(self, nc: Bus, max_queue_len: int, no_engine_timeout_s: float = 60.0) -> None:
        self.nc = nc
        self.incarnation = uuid.uuid4().hex[:12]
        self.queue = AdmissionQueue(max_queue_len, no_engine_timeout_s=no_engine_timeout_s)
        self._last_status: AdmissionStatus | None = None
        self.telemetry = AdmissionTelemetry(self.queue)
        self.metrics = SnapshotPublisher(nc, self.telemetry.snapshot)

    async def start(self) -> None:
        await self.nc.subscribe(subjects.ADMISSION_SUBMIT, cb=self.on_submit)
        await self.nc.subscribe(subjects.ENGINE_STATUS, cb=self.on_status)
        await self.nc.subscribe(subjects.ENGINE_PROGRESS, cb=self.on_status)
        await self.nc.subscribe(subjects.ABORT, cb=self.on_abort)
        self._heartbeat = asyncio.create_task(self._publish_periodically())
        self._watch = asyncio.create_task(self._watch_engines())
        self.metrics.start()
        on_reconnect(self.nc, self.on_reconnected)

    def on_reconnected(self) -> None:
        """Admits sent while NATS was away may be lost: those not acknowledged go again at once. The
        engines' statuses it missed meanwhile say nothing of them: each gets a full expiry to be heard."""
        self.queue.heartbeats.restart_clocks(time.monotonic())
        asyncio.get_running_loop().create_task(self._send_again(older_than_s=0.0))

    async def _send_again(self, older_than_s: float = ADMIT_RESEND_S, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for replica, sequence, requests in self.queue.unacknowledged(now, older_than_s):
            log.warning("admit %d to engine %s not acknowledged; sending it again", sequence, replica)
            await self.nc.publish(subjects.engine_admit(replica), Codec.encode(Admit(sequence, requests,
                                                                                      self._incarnation_of(replica))))

    async def stop(self) -> None:
        for task in (self._heartbeat, self._watch):
            task.cancel()
        await asyncio.gather(self._heartbeat, self._watch, return_exceptions=True)
        await self.metrics.stop()

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self.check_engines(time.monotonic())

    async def check_engines(self, now: float) -> None:
        """Drop engines silent past the expiry (at once: nothing more is routed to them), end what
        waited too long for any engine at all, and send again the admits still unacknowledged. Not while
        NATS is away: it hears no engine then, and would take its own outage for theirs."""
        if not self.nc.is_connected:
            return
        await self._send_again(now=now)
        gone = self.queue.expire(now)
        if gone:
            log.warning("engine(s) %s silent for %.0f s: no longer routed to", gone, self.queue.heartbeats.expiry_s)
            await self.publish_status()
        starved = self.queue.starved(now)
        for request in starved:
            await self._end(request, FinishReason.ERROR,
                            f"no engine has been available for {self.queue.no_engine_timeout_s:.0f} s; retry later",
                            retry=True)
        if starved:
            await self.publish_status()

    async def _publish_periodically(self, every_s: float = 1.0) -> None:
        """Also without changes, so a gateway that starts later learns the state within a second."""
        while True:
            await asyncio.sleep(every_s)
            self._last_status = None
            await self.publish_status()

    async def on_submit(self, msg: Msg) -> None:
        request = request_codec.decode(msg.data)
        self.telemetry.on_submit(request)
        reason = self.queue.unservable(request)
        try:
            if reason is not None:
                raise ValueError(reason)
            self.queue.submit(request)
        except (ValueError, QueueFull) as exc:
            self.telemetry.on_rejected(exc)
            await self._end(request, FinishReason.ERROR, str(exc), retry=isinstance(exc, QueueFull))
            return
        await self._admit()

    async def on_status(self, msg: Msg) -> None:
        self.queue.on_status(status_codec.decode(msg.data), time.monotonic())
        await self._admit()

    async def on_abort(self, msg: Msg) -> None:
        try:
            request_id = decode_abort(msg.data).id
        except ValueError as exc:
            log.warning("bad abort message: %s", exc)
            return
        queued = self.queue.remove(request_id)
        if queued is not None:
            await self._end(queued, FinishReason.ABORT)
            await self.publish_status()
        else:  # admitted already (or unknown): engines end it if they hold it
            await self.nc.publish(subjects.CANCEL, Codec.encode(Cancel(request_id, FinishReason.ABORT)))

    async def _admit(self) -> None:
        for replica, sequence, requests in self.queue.decide(time.monotonic()):
            self.telemetry.on_admitted(replica, requests)
            await self.nc.publish(subjects.engine_admit(replica), Codec.encode(Admit(sequence, requests,
                                                                                      self._incarnation_of(replica))))
            await self._tell_owners(replica, requests)
        await self.publish_status()

    def _incarnation_of(self, replica: str) -> str:
        return self.queue.engines[replica].status.incarnation

    async def _tell_owners(self, replica: str, requests: list[TokenizedRequest]) -> None:
        """After the Admit, on the same connection: a tokenizer never hears of a placement before
        the engine could have it."""
        incarnation = self.queue.engines[replica].status.incarnation
        by_owner: dict[str, list[str]] = {}
        for request in requests:
            by_owner.setdefault(request.tokenizer_instance, []).append(request.request_id)
        for owner, ids in by_owner.items():
            await self.nc.publish(subjects.placed(owner), Codec.encode(Placed(replica, incarnation, ids)))

    async def publish_status(self) -> None:
        ready = sum(1 for view in self.queue.engines.values() if view.status.ready)
        status = AdmissionStatus(len(self.queue.queue), self.queue.max_queue_len, ready, self.incarnation)
        if status != self._last_status:
            self._last_status = status
            await self.nc.publish(subjects.ADMISSION_STATUS, Codec.encode(status))

    async def _end(self, request: TokenizedRequest, reason: FinishReason, error: str | None = None,
                   retry: bool = False) -> None:
        self.telemetry.on_ended(request, reason, error)
        outputs = IterationOutputs([RequestOutput(request.request_id, finish_reason=reason, error=error, retry=retry)])
        await self.nc.publish(subjects.detok(request.tokenizer_instance), Codec.encode(outputs))
