"""Durable jobs over JetStream: exactly one generation and one stored result per job id.

Producers publish to `orca.v1.jobs.submit` (a work-queue stream) with a `Nats-Msg-Id`
header; JetStream drops duplicates published inside its window. A job is generated
through the normal `orca.v1.generate` path, its result stored on
`orca.v1.jobs.result.<id>` (a stream keeping the last message per subject, so a producer
can read it later), and only then acked. A redelivered job whose result is already stored
is acked without generating again.

A job's generation follows the README's client rule (`shared.client.generate`): it arrives whole
through a NATS restart, a failover between cluster nodes or the death of its tokenizer (events in
`seq` order, replayed after a gap, a silence or a reconnect; resent when nobody holds it). One that
takes no event for IDLE_EVENT_TIMEOUT_S is nak'ed and generated again, under a new request id.

On a NATS cluster both streams keep `replicas` copies (ORCA_JETSTREAM_REPLICAS: 3 on a cluster of
three or more servers, so that they outlive any one server; 1, the default, on a single server).
A stream found with fewer is scaled up when JetStream can (enough servers up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared import subjects
from shared.api import AbortRequest, decode_generate_request, encode_json
from shared.client import generate

log = logging.getLogger("orca.jobs")
DUPLICATE_WINDOW_S = 600.0
BEATS_PER_ACK_WAIT = 3
"""A job's heartbeats within the consumer's ack wait (ServeConfig.jobs_ack_wait): two may be late."""
IDLE_EVENT_TIMEOUT_S = 300.0
"""A generation that takes no event this long (a queued job waits silently too) is given up and retried."""
JOB_TIMEOUT_S = 24 * 3600.0
RETRY_DELAY_S = 2.0
MAX_REPLICAS = 5
"""JetStream's own limit on a stream's replicas."""


class JobResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """Same shape as an `orca generate` output line."""

    id: str
    finish_reason: str
    prompt_token_ids: list[int] = []
    token_ids: list[int] = []
    text: str = ""
    error: str | None = None
    metrics: dict[str, float] = {}


def stream_configs(replicas: int = 1) -> list[StreamConfig]:
    """The jobs work queue and the results store, each with `replicas` copies."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"JetStream replicas {replicas}: want 1 to {MAX_REPLICAS} (at most the cluster's servers)")
    return [
        StreamConfig(name=subjects.JOBS_STREAM, subjects=[subjects.JOBS_SUBMIT], retention=RetentionPolicy.WORK_QUEUE,
                     storage=StorageType.FILE, duplicate_window=DUPLICATE_WINDOW_S, num_replicas=replicas),
        StreamConfig(name=subjects.JOBS_RESULTS_STREAM, subjects=[f"{subjects.JOBS_RESULT_PREFIX}.>"],
                     storage=StorageType.FILE, max_msgs_per_subject=1, num_replicas=replicas),
    ]


async def ensure_streams(nc: Client, replicas: int = 1) -> None:
    js = nc.jetstream()
    for config in stream_configs(replicas):
        await ensure_stream(js, config)


async def ensure_stream(js, config: StreamConfig) -> None:
    """Create the stream, or find it: one with fewer replicas than `config` asks is scaled up if
    JetStream can (else it stays, with a warning: it works, only less durably); one with as many or
    more is kept as it is."""
    try:
        await js.add_stream(config)  # creates it, or finds it with this very config
        return
    except APIError as exc:
        refused = exc
    try:
        found = (await js.stream_info(config.name)).config
    except NotFoundError:
        raise RuntimeError(f"JetStream refused to create stream {config.name} with {config.num_replicas} "
                           f"replica(s): {refused.description}") from None
    have = found.num_replicas or 1
    if have >= config.num_replicas:
        log.info("stream %s kept as found (%d replica(s)): %s", config.name, have, refused.description)
        return
    try:
        await js.update_stream(dataclasses.replace(found, num_replicas=config.num_replicas))
        log.info("stream %s: %d -> %d replicas", config.name, have, config.num_replicas)
    except APIError as exc:
        log.warning("stream %s keeps %d replica(s): JetStream refused %d (%s)", config.name, have,
                    config.num_replicas, exc.description)


class JobsService:
    def __init__(self, nc: Client, concurrency: int = 64, replicas: int = 1, ack_wait_s: float = 30.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.replicas = replicas
        self.ack_wait_s = ack_wait_s
        self.concurrency = asyncio.Semaphore(concurrency)
        self.in_flight: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await ensure_streams(self.nc, self.replicas)
        self.sub = await self.js.pull_subscribe(
            subjects.JOBS_SUBMIT, durable=subjects.JOBS_CONSUMER, stream=subjects.JOBS_STREAM,
            config=ConsumerConfig(ack_wait=self.ack_wait_s, max_ack_pending=1024))
        await self._apply_ack_wait()
        self._loop = asyncio.create_task(self._pull())

    async def _apply_ack_wait(self) -> None:
        """The durable consumer outlives its services: one made with another ack wait gets this one."""
        info = await self.js.consumer_info(subjects.JOBS_STREAM, subjects.JOBS_CONSUMER)
        if info.config.ack_wait is not None and abs(info.config.ack_wait - self.ack_wait_s) < 1e-3:
            return
        log.info("jobs consumer: ack wait %s -> %s s", info.config.ack_wait, self.ack_wait_s)
        await self.js.add_consumer(subjects.JOBS_STREAM, dataclasses.replace(info.config, ack_wait=self.ack_wait_s))

    async def stop(self, drain_timeout_s: float = 0.0, cut_short: asyncio.Event | None = None) -> None:
        """Stop pulling, let jobs in progress finish for up to `drain_timeout_s` (or until `cut_short`
        is set), then cancel the rest: they are not acked, so JetStream hands them out again."""
        self._loop.cancel()
        await asyncio.gather(self._loop, return_exceptions=True)
        await self.sub.unsubscribe()  # else draining the connection waits out a pending fetch
        if self._tasks:
            waits = [asyncio.gather(*self._tasks, return_exceptions=True)]
            if cut_short is not None:
                waits.append(asyncio.ensure_future(cut_short.wait()))
            _, pending = await asyncio.wait(waits, timeout=drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            for wait in pending:
                wait.cancel()
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
        if not subjects.is_valid_tail(job_id):
            await self._refuse_id(job_id, msg)
            return
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

    async def _refuse_id(self, job_id: str, msg) -> None:
        """A job id that cannot name a subject has no result subject to be stored under: its error goes
        under the job's stream sequence instead, and it is acked (redelivered, it would fail forever)."""
        stored_as = f"seq-{msg.metadata.sequence.stream}"
        error = (f"job id {job_id!r} cannot name its result subject ({subjects.jobs_result('<id>')}): give a "
                 "Nats-Msg-Id (or body id) without spaces, wildcards or empty dot-separated parts")
        log.warning("job stored as %s: %s", stored_as, error)
        try:
            result = encode_json(JobResult(stored_as, "error", error=error))
            await self.js.publish(subjects.jobs_result(stored_as), result, headers={"Nats-Msg-Id": f"result-{stored_as}"})
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - not acked: JetStream redelivers it
            log.warning("job %s not finished (%s); it will be redelivered", stored_as, exc)
            await msg.nak(delay=RETRY_DELAY_S)

    async def _keep_alive(self, msg) -> None:
        """Tell JetStream the job is still being worked on (queued or generating), so only a
        consumer that died has its jobs redelivered."""
        while True:
            await asyncio.sleep(self.ack_wait_s / BEATS_PER_ACK_WAIT)
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
        start = time.monotonic()
        try:
            events = await generate(self.nc, body, timeout_s=JOB_TIMEOUT_S, idle_timeout_s=IDLE_EVENT_TIMEOUT_S)
        except TimeoutError:
            await self.nc.publish(subjects.ABORT, encode_json(AbortRequest(body["id"])))
            raise
        return job_result(job_id, events, time.monotonic() - start)


def job_result(job_id: str, events: list[dict], latency_s: float) -> JobResult:
    """A generation's events, in order, the final one last, as the job's result."""
    final = events[-1]
    tokens = [t for e in events for t in e.get("token_ids") or []]
    text = "".join(e.get("text") or "" for e in events)
    return JobResult(job_id, final["finish_reason"], final.get("prompt_token_ids") or [], tokens, text,
                     final.get("error"), {"latency_s": round(latency_s, 6)})
