"""The tokenizer's part in surviving failures behind it (the rules: core/placements.py), and in
its clients' survival of its own death.

Behind it: it listens to engine and admission statuses and to admission's `Placed` notes, and
resumes (with the tokens it has sent) or resubmits whatever a dead engine or admission held.

In front of it: it publishes a heartbeat (`TokenizerStatus`, for the gateways' /health) and
answers `orca.v1.generate.held` for the requests it holds. A client whose stream falls silent asks
that; if no tokenizer answers, the one that held the stream is gone, and the client sends the
request again with `resume_token_ids` (what it has received) to the same reply subject: any
tokenizer continues it from there (`prime`). A tokenizer that still holds it only takes the
(possibly new) reply subject.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from core.placements import Placements
from shared import subjects
from shared.api import GenerateRequest, HeldReply, decode_abort, encode_json
from shared.codec import Codec
from shared.messages import (HEARTBEAT_S, MAX_RESUMES, AdmissionStatus, EngineStatus, Placed, TokenizedRequest,
                             TokenizerStatus)

if TYPE_CHECKING:
    from services.tokenizer.service import ActiveRequest, TokenizerService

log = logging.getLogger("orca.tokenizer")
engine_codec, admission_codec, placed_codec = Codec(EngineStatus), Codec(AdmissionStatus), Codec(Placed)
TICK_S = 0.25
"""How often engines' heartbeats are checked (and the tokenizer's own published, every fourth)."""
NO_ADMISSION = "no admission service has been listening for {:.0f} s; retry later"
GAVE_UP = "the engines serving this request failed {} times; giving up"


class Recovery:
    def __init__(self, service: TokenizerService, no_admission_timeout_s: float = 30.0) -> None:
        self.service = service
        self.placements = Placements(no_admission_timeout_s=no_admission_timeout_s)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        nc = self.service.nc
        await nc.subscribe(subjects.placed(self.service.instance), cb=self._on_placed)
        await nc.subscribe(subjects.ENGINE_STATUS, cb=self._on_engine_status)
        await nc.subscribe(subjects.ADMISSION_STATUS, cb=self._on_admission_status)
        await nc.subscribe(subjects.GENERATE_HELD, cb=self._on_held)
        self._task = asyncio.get_running_loop().create_task(self._tick_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submitted(self, tokenized: TokenizedRequest) -> None:
        self.placements.submitted(tokenized)

    async def resubmit_unplaced(self) -> None:
        """After NATS was away: a submission, an admission's `Placed` note or its final output for a
        request may be lost. What no engine is known to hold is submitted again, as it was (admission
        keeps one copy of a request it still queues; an engine ignores the same copy twice)."""
        for request_id in self.placements.unplaced():
            if request_id in self.service.active:
                await self.service._submit(self.placements.tracked[request_id].tokenized)

    def reconnected(self) -> None:
        self.placements.on_reconnected(time.monotonic())

    def bounced(self, request_id: str) -> None:
        """No admission received it: it waits (up to the timeout) for one to come back."""
        self.placements.bounced(request_id, time.monotonic())

    # ---- behind: engines and admission ---------------------------------------------------------

    async def _on_placed(self, msg: Msg) -> None:
        await self._resume(self.placements.placed(placed_codec.decode(msg.data), time.monotonic()))

    async def _on_engine_status(self, msg: Msg) -> None:
        status = engine_codec.decode(msg.data)
        await self._resume(self.placements.on_engine_status(status, time.monotonic()))

    async def _on_admission_status(self, msg: Msg) -> None:
        status = admission_codec.decode(msg.data)
        for request_id in self.placements.on_admission_status(status, time.monotonic()):
            tracked = self.placements.tracked[request_id]
            if request_id in self.service.active:
                await self.service._submit(tracked.tokenized)  # the same copy: admission dedupes it

    async def _tick_forever(self) -> None:
        for beat in itertools.count():
            await asyncio.sleep(TICK_S)
            try:
                await self.tick(time.monotonic())
                if beat % round(2 * HEARTBEAT_S / TICK_S) == 0:
                    await self.publish_status()
            except Exception:  # noqa: BLE001 - a bad round must not end the recovery of later ones
                log.exception("recovery round failed")

    async def tick(self, now: float) -> None:
        if not self.service.nc.is_connected:
            # It hears nobody: judging the engines now would take its own outage for theirs. The clocks
            # start again when the connection is back (`reconnected`).
            return
        self.placements.keep_only(self.service.active)
        decisions = self.placements.tick(now)
        await self._resume(decisions.resume)
        for request_id in decisions.give_up:
            state = self.service.active.pop(request_id, None)
            if state is not None:
                await self.service._end_with_error(request_id, state,
                                                   NO_ADMISSION.format(self.placements.no_admission_timeout_s),
                                                   retry=True)

    async def _resume(self, request_ids: list[str]) -> None:
        """Resubmit requests their engine lost, with the tokens their clients already have."""
        for request_id in request_ids:
            state, tracked = self.service.active.get(request_id), self.placements.tracked.get(request_id)
            if state is None or tracked is None:
                continue
            copy = tracked.tokenized
            if copy.resumes >= MAX_RESUMES:
                del self.service.active[request_id]
                await self.service._end_with_error(request_id, state, GAVE_UP.format(copy.resumes + 1))
                continue
            log.warning("resuming %s after %d tokens: its engine is gone", request_id, len(state.detokenizer.token_ids))
            await self.service._submit(msgspec.structs.replace(
                copy, resume_token_ids=list(state.detokenizer.token_ids), resumes=copy.resumes + 1))

    # ---- in front: clients -----------------------------------------------------------------------

    async def publish_status(self) -> None:
        status = TokenizerStatus(self.service.instance, len(self.service.active), self.service.draining)
        await self.service.nc.publish(subjects.TOKENIZER_STATUS, Codec.encode(status))

    async def _on_held(self, msg: Msg) -> None:
        try:
            request_id = decode_abort(msg.data).id  # the same {"id"} body
        except ValueError:
            return
        # an ended request too, while its events are kept for replays (as `.replay` answers for it): a
        # client that missed its last event would otherwise take it for lost and send it again
        if msg.reply and (request_id in self.service.active or request_id in self.service.ended):
            await self.service.nc.publish(msg.reply, encode_json(HeldReply(request_id)))


def reattach(state: ActiveRequest, reply: str) -> None:
    """A client resent a request this instance still holds (it took this instance for gone): the
    stream goes on, to the reply subject it named this time."""
    state.reply = reply


def resume_ids(request: GenerateRequest, vocab_size: int) -> list[int]:
    """The tokens a client resending its request already has (checked), or []."""
    resumed = request.resume_token_ids or []
    bad = next((t for t in resumed if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"resume token id {bad} is outside the vocabulary [0, {vocab_size})")
    if request.max_tokens is not None and len(resumed) >= request.max_tokens:
        raise ValueError(f"resume_token_ids holds {len(resumed)} tokens: max_tokens ({request.max_tokens}) "
                         "is reached already")
    return list(resumed)


def prime(state: ActiveRequest, resumed: list[int]) -> None:
    """A request resumed by its client: the tokens it already has go through the detokenizer
    unsent, one at a time as the tokenizer that streamed them took them, so the text continues exactly
    where that client's stopped (also when it stopped on a byte that no character completes yet: added
    at once, such a tail held the whole text back, and the next token sent it all again)."""
    for token in resumed:
        state.detokenizer.add((token,))
    state.num_generated = len(resumed)
