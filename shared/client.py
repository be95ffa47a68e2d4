"""A NATS producer's side of `orca.v1.generate`, following the README's client rule ("When things
fail"), so that a stream arrives whole through a NATS restart, a cluster failover or the death of
the tokenizer serving it:

- events are taken in `seq` order: a repeat is dropped; a gap, 2 s of silence, or a reconnect of
  this client's connection asks `orca.v1.generate.replay` for the events from the first missing;
- when no tokenizer answers that, the one holding the request is gone: the request is sent again,
  to the same reply subject, with `resume_token_ids` (the tokens received) and `resume_seq`;
- while NATS answers "no responders" (no tokenizer listens yet), the send is retried every
  RETRY_S, up to NO_TOKENIZER_RETRY_S.

`examples/nats_producer.py` uses it; so do the reliability tests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from core.streams import Arrival, arrival
from shared import subjects

SILENCE_S = 2.0
ANSWER_TIMEOUT_S = 1.0
RETRY_S = 0.5
NO_TOKENIZER_RETRY_S = 30.0


def _error(request_id: str, message: str, retry: bool = False) -> dict:
    event = {"id": request_id, "token_ids": [], "text": "", "finish_reason": "error", "error": message}
    return {**event, "retry": True} if retry else event


async def generate(nc: Client, body: dict, timeout_s: float = 600.0, on_event: Callable[[dict], None] | None = None,
                   stats: dict | None = None, idle_timeout_s: float | None = None) -> list[dict]:
    """The request's events in order, the final one last. TimeoutError if it has not ended within
    `timeout_s`, or taken no event for `idle_timeout_s` (nothing waits forever). `stats` counts
    "replays", "resends" and "retries"."""
    stats = stats if stats is not None else {}
    request_id = body["id"]
    deadline = time.monotonic() + timeout_s
    await _until_connected(nc, deadline, request_id)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    events: list[dict] = []
    tokens: list[int] = []
    heard, refused_since, reconnects = time.monotonic(), None, nc.stats["reconnects"]
    taken_at = heard

    async def send() -> None:
        """The request; once a tokenizer may have taken it, as a resend (a tokenizer that still holds it
        only takes the reply subject, another continues after the tokens received)."""
        sent = {**body, "resume_token_ids": tokens, "resume_seq": len(events)} if stats.get("resends") else body
        await nc.publish(subjects.GENERATE, json.dumps(sent).encode(), reply=inbox)

    replayed_up_to = 0  # the events up to this seq are on their way again: a gap below it needs no new replay

    async def replay_or_resend() -> None:
        nonlocal replayed_up_to
        stats["replays"] = stats.get("replays", 0) + 1
        try:
            answer = await ask(nc, subjects.GENERATE_REPLAY,
                               json.dumps({"id": request_id, "from_seq": len(events)}).encode(), ANSWER_TIMEOUT_S)
        except NoAnswer:  # the tokenizer that held it is gone
            stats["resends"] = stats.get("resends", 0) + 1
            await send()
            return
        replayed_up_to = max(replayed_up_to, json.loads(answer.data).get("next_seq", 0))

    try:
        await send()  # after the SUB on the same connection: the server has the reply subject first
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{request_id}: no final event within {timeout_s} s ({len(events)} events)")
            if idle_timeout_s is not None and time.monotonic() - taken_at > idle_timeout_s:
                raise TimeoutError(f"{request_id}: no event for {idle_timeout_s} s ({len(events)} events)")
            try:
                msg = await sub.next_msg(timeout=min(left, RETRY_S))
            except nats.errors.TimeoutError:
                if nc.stats["reconnects"] != reconnects and nc.is_connected:
                    reconnects = nc.stats["reconnects"]
                    await replay_or_resend()
                elif time.monotonic() - heard >= SILENCE_S and nc.is_connected:
                    heard = time.monotonic()
                    await replay_or_resend()
                continue
            if msg.headers and msg.headers.get("Status") == "503":  # no tokenizer listens (yet)
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since > NO_TOKENIZER_RETRY_S:
                    events.append(_error(request_id, "no tokenizer service listened (NATS: no responders)", retry=True))
                    return events
                stats["retries"] = stats.get("retries", 0) + 1
                await asyncio.sleep(RETRY_S)
                await send()
                continue
            event = json.loads(msg.data)
            seen = arrival(len(events), event.get("seq", 0))
            if seen is Arrival.REPEAT:
                continue
            if seen is Arrival.GAP:
                if event.get("seq", 0) >= replayed_up_to:  # else the replay asked for already brings it
                    await replay_or_resend()
                continue
            heard, refused_since = time.monotonic(), None
            taken_at = heard
            events.append(event)
            tokens += event["token_ids"]
            if on_event is not None:
                on_event(event)
            if event["finish_reason"] is not None:
                return events
    finally:
        await sub.unsubscribe()


async def _until_connected(nc: Client, deadline: float, request_id: str) -> None:
    """Subscribe only on a live connection. nats.py queues a SUB made while it reconnects and sends it once
    back, but drops an UNSUB made meanwhile: a subscription made and ended inside one outage stays on the
    server for good (seen in the soak test: a jobs connection kept an inbox of a replay asked mid-restart)."""
    while not nc.is_connected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id}: NATS did not reconnect in time")
        await asyncio.sleep(0.05)


class NoAnswer(Exception):
    """Nobody answered in time, or NATS said no one subscribes ("no responders")."""


async def ask(nc: Client, subject: str, data: bytes, timeout_s: float) -> Msg:
    """One request/reply on a reply subject of its own. Not nats.py's `request`: that creates a wildcard
    response subscription at its first use and keeps it for good (a service's subscriptions would grow).
    While the connection is down there is no one to ask, and a subscription made then could outlive it
    (`_until_connected`)."""
    if not nc.is_connected:
        raise NoAnswer(f"no answer on {subject}: not connected")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    try:
        await nc.publish(subject, data, reply=inbox)
        msg = await sub.next_msg(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a timeout, or the connection went away meanwhile
        raise NoAnswer(f"no answer on {subject}: {type(exc).__name__}") from exc
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - max_msgs reached, or the connection is closed
            pass
    if msg.headers and msg.headers.get("Status") == "503":
        raise NoAnswer(f"no responders on {subject}")
    return msg
