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

A job whose generation ends with an error that passes (its final event has `retry`: no tokenizer or no
engine for a while, the admission queue full, a tokenizer shutting down) gets no result: it is nak'ed
with a delay (`retry_delay_s`: 2 s doubling per delivery, jittered, at most MAX_RETRY_DELAY_S) and
JetStream hands it out again then, for as long as it takes: the consumer sets no max_deliver. Where an
operator gave the durable consumer one, the last delivery it allows stores the error as the result,
so that the job does not end with none. Any other error is the job's result, as a success is.

On a NATS cluster both streams keep `replicas` copies (ORCA_JETSTREAM_REPLICAS: 3 on a cluster of
three or more servers, so that they outlive any one server; 1, the default, on a single server).
A stream found with fewer is scaled up when JetStream can (enough servers up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time

import msgspec
from msgspec import UNSET, UnsetType
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared import subjects
from shared.api import AbortRequest, EventLogprob, decode_generate_request, encode_json
from shared.client import generate
from shared.tools import ToolCall

log = logging.getLogger("orca.jobs")
DUPLICATE_WINDOW_S = 600.0
BEATS_PER_ACK_WAIT = 3
"""A job's heartbeats within the consumer's ack wait (ServeConfig.jobs_ack_wait): two may be late."""
IDLE_EVENT_TIMEOUT_S = 300.0
"""A generation that takes no event this long (a queued job waits silently too) is given up and retried."""
JOB_TIMEOUT_S = 24 * 3600.0
RETRY_DELAY_S = 2.0
"""A job not finished for a fault here (NATS away, a generation gone silent) is handed out again after this."""
MAX_RETRY_DELAY_S = 30.0
"""The longest a job whose error passes (`retry`) waits to be handed out again."""
MAX_DEFERRED_LOGGED = 10_000
"""Jobs remembered as already logged while deferred (each is logged once, at its first deferral)."""
MAX_REPLICAS = 5
"""JetStream's own limit on a stream's replicas."""


class JobResult(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """Same shape as an `orca generate` output line (engine/batch_job.py): a generation's result has the
    fields of `completion_record`, in its order (`stop_reason`, `tool_calls`, `logprobs`, `prompt_logprobs`
    and `error` only when there are any); a job refused before generating (malformed, or an id that cannot
    name a subject) has those of `error_record`: id, finish_reason and error."""

    id: str
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    text: str | UnsetType = UNSET
    finish_reason: str
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, when one did (vLLM's `stop_reason`)."""
    tool_calls: list[ToolCall] | None = None
    """The final event's: a request with tools whose model called any."""
    logprobs: list[EventLogprob] | None = None
    """One per token of `token_ids`, when the job asked for logprobs."""
    prompt_logprobs: list[EventLogprob] | None = None
    """One per prompt token after the first, when the job asked for prompt_logprobs and its first token came."""
    error: str | None = None
    metrics: dict[str, float | None] | UnsetType = UNSET
    """`queue_s`, `ttft_s` and `latency_s`, in seconds from the job's submission to `orca.v1.generate`
    (by this service) to its first token and to its final event; None where unknown: `queue_s` always
    (no event tells when an engine first scheduled the request), `ttft_s` when no token came."""


def retry_delay_s(num_delivered: int) -> float:
    """How long a job whose error passes waits before JetStream hands it out again: 2 s after its first
    delivery, doubling, jittered (jobs deferred together come back spread out), at most MAX_RETRY_DELAY_S."""
    base = RETRY_DELAY_S * 2.0 ** min(max(num_delivered, 1) - 1, 16)
    return min(base * random.uniform(0.75, 1.25), MAX_RETRY_DELAY_S)


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
        self.max_deliver: int | None = None
        """The durable consumer's (None or <= 0: no limit, the default here)."""
        self._deferred: set[str] = set()
        """Jobs this instance deferred (error with `retry`) and logged so: a job is logged once."""
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
        self.max_deliver = info.config.max_deliver  # an operator's, kept below: replace() changes ack_wait only
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
                result, retry = await self._generate(job_id, msg)
                if retry and not self._last_delivery(msg):
                    await self._defer(job_id, msg, result)
                    return
                if retry:
                    result = msgspec.structs.replace(result, error=(
                        f"{result.error} (gave up: delivery {msg.metadata.num_delivered} of the jobs consumer's "
                        f"max_deliver {self.max_deliver})"))
                self._deferred.discard(job_id)
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

    def _last_delivery(self, msg) -> bool:
        """Whether JetStream will not hand this job out again (the consumer's max_deliver, where set)."""
        return self.max_deliver is not None and 0 < self.max_deliver <= msg.metadata.num_delivered

    async def _defer(self, job_id: str, msg, result: JobResult) -> None:
        """A job whose error passes: no result, nak'ed with a delay, so JetStream hands it out again later
        (the same job id: a stored result would have made it final). Logged once per job."""
        delay = retry_delay_s(msg.metadata.num_delivered)
        if job_id not in self._deferred:
            if len(self._deferred) >= MAX_DEFERRED_LOGGED:
                self._deferred.clear()
            self._deferred.add(job_id)
            log.warning("job %s deferred: %s; JetStream hands it out again in %.1f s (and so on, up to %.0f s "
                        "apart, until it runs)", job_id, result.error, delay, MAX_RETRY_DELAY_S)
        else:
            log.debug("job %s deferred again (delivery %d): %s; next in %.1f s", job_id,
                      msg.metadata.num_delivered, result.error, delay)
        await msg.nak(delay=delay)

    async def _refuse_id(self, job_id: str, msg) -> None:
        """A job id that cannot name a subject has no result subject to be stored under: its error goes
        under the job's stream sequence instead, and it is acked (redelivered, it would fail forever)."""
        stored_as = f"seq-{msg.metadata.sequence.stream}"
        error = (f"job id {job_id!r} cannot name its result subject ({subjects.jobs_result('<id>')}): give a "
                 "Nats-Msg-Id (or body id) without spaces, wildcards or empty dot-separated parts")
        log.warning("job stored as %s: %s", stored_as, error)
        try:
            result = encode_json(JobResult(id=stored_as, finish_reason="error", error=error))
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

    async def _generate(self, job_id: str, msg) -> tuple[JobResult, bool]:
        """The job's result, and whether its error passes (the final event's `retry`): then it is not final."""
        try:
            body = msgspec.json.decode(msg.data)
            if not isinstance(body, dict):
                raise ValueError("a job must be a JSON object")
            # One request id per delivery: an abort of an interrupted attempt must not reach the next.
            body["id"] = f"{job_id}~{msg.metadata.num_delivered}"
        except (msgspec.DecodeError, ValueError) as exc:
            return JobResult(id=job_id, finish_reason="error", error=f"malformed job: {exc}"), False
        start = time.monotonic()
        first_token_at: list[float] = []

        def on_event(event: dict) -> None:
            if not first_token_at and event.get("token_ids"):
                first_token_at.append(time.monotonic())

        try:
            events = await generate(self.nc, body, timeout_s=JOB_TIMEOUT_S, idle_timeout_s=IDLE_EVENT_TIMEOUT_S,
                                    on_event=on_event)
        except TimeoutError:
            await self.nc.publish(subjects.ABORT, encode_json(AbortRequest(body["id"])))
            raise
        end = time.monotonic()
        metrics = {"queue_s": None, "ttft_s": round(first_token_at[0] - start, 6) if first_token_at else None,
                   "latency_s": round(end - start, 6)}
        final = events[-1]
        retry = final.get("finish_reason") == "error" and bool(final.get("retry"))
        return job_result(job_id, events, metrics, logprobs=body.get("logprobs") is not None), retry


def job_result(job_id: str, events: list[dict], metrics: dict[str, float | None], logprobs: bool = False) -> JobResult:
    """A generation's events, in order, the final one last, as the job's result: an `orca generate`
    record. `logprobs`: the job asked for them (the result then has a list, even if no token came)."""
    final = events[-1]
    tokens = [t for e in events for t in e.get("token_ids") or []]
    text = "".join(e.get("text") or "" for e in events)
    token_logprobs = [lp for e in events for lp in e.get("logprobs") or []]
    tool_calls = final.get("tool_calls") or None
    prompt_logprobs = next((e["prompt_logprobs"] for e in events if e.get("prompt_logprobs") is not None), None)
    return JobResult(
        id=job_id, prompt_token_ids=final.get("prompt_token_ids") or [], token_ids=tokens, text=text,
        finish_reason=final["finish_reason"], stop_reason=final.get("stop_reason"),
        tool_calls=msgspec.convert(tool_calls, list[ToolCall]) if tool_calls else None,
        logprobs=msgspec.convert(token_logprobs, list[EventLogprob]) if logprobs or token_logprobs else None,
        prompt_logprobs=msgspec.convert(prompt_logprobs, list[EventLogprob]) if prompt_logprobs is not None else None,
        error=final.get("error"), metrics=metrics)
