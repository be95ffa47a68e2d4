"""Durable jobs over JetStream: exactly one generation and one stored result per job id.

Producers publish to `orca.v1.jobs.submit` (a work-queue stream) with a `Nats-Msg-Id`
header; JetStream drops duplicates published inside its window. A job is generated
through the normal `orca.v1.generate` path, its result stored on
`orca.v1.jobs.result.<id>` (a stream keeping the last message per subject, so a producer
can read it later), and only then acked. A redelivered job whose result is already stored
is acked without generating again.

A generation during which this service's NATS connection dropped is not trusted (core NATS
may have lost some of its events): the job is nak'ed and generated again, under a new request
id, rather than stored truncated or stored with the error the outage caused.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType
from nats.js.errors import NotFoundError

from shared import subjects
from shared.api import AbortRequest, decode_generate_request, encode_json

log = logging.getLogger("orca.jobs")
DUPLICATE_WINDOW_S = 600.0
ACK_WAIT_S = 30.0
"""A job whose consumer died is handed out again this long after its last heartbeat."""
HEARTBEAT_S = ACK_WAIT_S / 3
IDLE_EVENT_TIMEOUT_S = 300.0
RETRY_DELAY_S = 2.0


class Interrupted(Exception):
    """The connection to NATS dropped while a job was generated: its events may be incomplete."""


class JobResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """Same shape as an `orca generate` output line."""

    id: str
    finish_reason: str
    prompt_token_ids: list[int] = []
    token_ids: list[int] = []
    text: str = ""
    error: str | None = None
    metrics: dict[str, float] = {}


async def ensure_streams(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(name=subjects.JOBS_STREAM, subjects=[subjects.JOBS_SUBMIT],
                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                        duplicate_window=DUPLICATE_WINDOW_S)
    await js.add_stream(name=subjects.JOBS_RESULTS_STREAM, subjects=[f"{subjects.JOBS_RESULT_PREFIX}.>"],
                        storage=StorageType.FILE, max_msgs_per_subject=1)


class JobsService:
    def __init__(self, nc: Client, concurrency: int = 64) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.concurrency = asyncio.Semaphore(concurrency)
        self.in_flight: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await ensure_streams(self.nc)
        self.sub = await self.js.pull_subscribe(
            subjects.JOBS_SUBMIT, durable=subjects.JOBS_CONSUMER, stream=subjects.JOBS_STREAM,
            config=ConsumerConfig(ack_wait=ACK_WAIT_S, max_ack_pending=1024))
        self._loop = asyncio.create_task(self._pull())

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop pulling, let jobs in progress finish for up to `drain_timeout_s`, then cancel the
        rest: they are not acked, so JetStream hands them out again."""
        self._loop.cancel()
        await asyncio.gather(self._loop, return_exceptions=True)
        await self.sub.unsubscribe()  # else draining the connection waits out a pending fetch
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=drain_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pull(self) -> None:
        while True:
            await self.concurrency.acquire()
            self.concurrency.release()
            try:
                messages = await self.sub.fetch(batch=16, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            except Exception as exc:  # noqa: BLE001 - reconnecting; try again shortly
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                task = asyncio.create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def job_id(self, msg) -> str:
        header = (msg.headers or {}).get("Nats-Msg-Id")
        if header:
            return header
        try:
            return decode_generate_request(msg.data).id
        except ValueError:
            return f"seq-{msg.metadata.sequence.stream}"

    async def _handle(self, msg) -> None:
        job_id = self.job_id(msg)
        if job_id in self.in_flight:
            return  # redelivered while this instance still works on it: the first one acks
        async with self.concurrency:
            self.in_flight.add(job_id)
            heartbeat = asyncio.create_task(self._keep_alive(msg))
            try:
                if await self.result_exists(job_id):
                    await msg.ack()
                    return
                result = await self._generate(job_id, msg)
                # The header makes a retried publish (its ack lost) store nothing twice.
                await self.js.publish(subjects.jobs_result(job_id), encode_json(result),
                                      headers={"Nats-Msg-Id": f"result-{job_id}"})
                await msg.ack()
            except Exception as exc:  # noqa: BLE001 - not acked: JetStream redelivers it
                log.warning("job %s not finished (%s); it will be redelivered", job_id, exc)
                await msg.nak(delay=RETRY_DELAY_S)
            finally:
                heartbeat.cancel()
                self.in_flight.discard(job_id)

    async def _keep_alive(self, msg) -> None:
        """Tell JetStream the job is still being worked on (queued or generating), so only a
        consumer that died has its jobs redelivered."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await msg.in_progress()
            except Exception as exc:  # noqa: BLE001 - reconnecting: the next beat may pass
                log.debug("heartbeat failed: %s", exc)

    async def result_exists(self, job_id: str) -> bool:
        try:
            await self.js.get_last_msg(subjects.JOBS_RESULTS_STREAM, subjects.jobs_result(job_id))
            return True
        except NotFoundError:
            return False

    async def _generate(self, job_id: str, msg) -> JobResult:
        try:
            body = msgspec.json.decode(msg.data)
            if not isinstance(body, dict):
                raise ValueError("a job must be a JSON object")
            # One request id per delivery: an abort of an interrupted attempt must not reach the next.
            body["id"] = f"{job_id}~{msg.metadata.num_delivered}"
        except (msgspec.DecodeError, ValueError) as exc:
            return JobResult(job_id, "error", error=f"malformed job: {exc}")
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        start = time.monotonic()
        reconnects = self.nc.stats["reconnects"]
        tokens: list[int] = []
        text: list[str] = []
        try:
            await self.nc.publish(subjects.GENERATE, msgspec.json.encode(body), reply=inbox)
            while True:
                event = await self._next_event(sub, reconnects)
                if event is None:
                    await self.nc.publish(subjects.ABORT, encode_json(AbortRequest(body["id"])))
                    raise Interrupted("the connection to NATS dropped during the generation")
                tokens.extend(event.get("token_ids") or [])
                text.append(event.get("text") or "")
                if event.get("finish_reason") is not None:
                    return JobResult(job_id, event["finish_reason"], event.get("prompt_token_ids") or [], tokens,
                                     "".join(text), event.get("error"),
                                     {"latency_s": round(time.monotonic() - start, 6)})
        finally:
            await sub.unsubscribe()

    async def _next_event(self, sub, reconnects: int) -> dict | None:
        """The next event of a generation, or None once this connection has reconnected since it
        began (then nothing it received can be trusted whole). Nothing for IDLE_EVENT_TIMEOUT_S
        raises (the job is then retried)."""
        deadline = time.monotonic() + IDLE_EVENT_TIMEOUT_S
        while self.nc.stats["reconnects"] == reconnects:
            try:
                data = (await sub.next_msg(timeout=1.0)).data
            except NatsTimeout:
                if time.monotonic() > deadline:
                    raise
                continue
            if self.nc.stats["reconnects"] != reconnects:
                return None
            return msgspec.json.decode(data)
        return None
