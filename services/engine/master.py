"""The engine master: the Orca loop of one model replica.

Every iteration: schedule (the pure core), send one step message to the workers, wait for
one result message, update, then publish the new tokens (one message per tokenizer
instance) and the engine's status (for admission). Admits and cancels arrive between
iterations on the same event loop, so the scheduler is only ever touched by one task.

With pipeline parallelism the loop keeps up to one iteration per stage in flight, each with
different requests (the scheduler leaves out requests in flight), and applies the results
in order: while the last stage works on one batch, the first already works on the next.
With one worker, async scheduling keeps two iterations in flight the same way: while the worker
runs N, N+1 is already scheduled and queued behind it (its decodes take the tokens the worker
samples at N), so the result round trip, the update and the publishing are off the critical path.

Liveness: a separate task publishes the status every HEARTBEAT_S whatever the loop waits on, so
a master that dies or hangs falls silent and everyone else counts it gone after STATUS_EXPIRY_S.
The incarnation names what this master holds: it changes when the master restarts (the requests
are gone; their tokenizers resume them, with the tokens already streamed) and when the master
finds its own heartbeat was stalled for long (it was hung, others have given its requests up, so
it drops them too). A worker that dies does not change it: the master resumes those requests itself.

NATS may go away for a while (a restart, a failover between cluster nodes) and core NATS keeps
nothing for a subscriber that is away. The engine keeps running, and no message is lost for good:
- outputs: each message to a tokenizer carries a sequence per tokenizer, and the last
  OUTPUTS_WINDOW_S of them are kept, so a tokenizer that missed some asks for them again;
- steps: after a reconnect of either side (the master's own, a worker's `WorkerResync`) the
  iterations in flight are sent again; a worker runs each iteration once and answers a repeat
  with the result it kept; the step timeout does not count the time NATS was away;
- admits: admission sends an Admit again until this engine's status acknowledges it; the
  acknowledgement only moves past admits that all arrived, and a repeat is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass

from nats.aio.msg import Msg

from core.batch import SchedulerOutput, StepResult
from core.request import Request
from core.scheduler import Scheduler
from core.streams import ReplayLog
from services.bus import Bus, on_reconnect
from services.engine.telemetry import EngineTelemetry
from services.engine.worker_group import StepTimedOut, WorkerDied, WorkerGroup
from shared import subjects
from shared.codec import Codec
from shared.config import EngineConfig
from shared.messages import (HEARTBEAT_S, MAX_RESUMES, STATUS_EXPIRY_S, Admit, Cancel, EngineStatus,
                             IterationOutputs, OutputsReplay, OutputsReplayed, TokenizedRequest, WorkerResync,
                             engine_source)
from shared.outputs import FinishReason, RequestOutput

log = logging.getLogger("orca.engine")
admit_codec, cancel_codec, result_codec = Codec(Admit), Codec(Cancel), Codec(StepResult)
replay_codec, resync_codec = Codec(OutputsReplay), Codec(WorkerResync)
OUTPUTS_WINDOW_S = 30.0
"""Outputs sent to tokenizers are kept this long for replays (a NATS outage longer than this loses
the outputs sent meanwhile: the requests concerned end with an error)."""
MAX_OUTPUTS_KEPT = 20_000
"""Messages kept per tokenizer at most, whatever their age."""
RECENT_CANCELS = 10_000
ITERATION_LOG_LENGTH = 10_000
STALL_RESET_S = STATUS_EXPIRY_S - 1.0
"""A gap this long between two of its own heartbeats means this master was hung (stopped, or its
loop blocked) long enough that others may have counted it gone: it starts over as a new
incarnation. Below the expiry, so it never keeps requests that tokenizers have resumed elsewhere."""
ITERATION_STATUS_S = 0.02
"""After an iteration that freed no KV, the status goes out only if the last one is this old. Sent after
every iteration, a single stream's 300 statuses a second cost admission and NATS CPU on each token for
news nobody acts on; an iteration that ends or preempts a request (KV freed: admission may send more)
still reports at once, and so does an Admit. These go to admission alone (ENGINE_PROGRESS): the tokenizers
and gateways need only the heartbeat and news of readiness or incarnation (`publish_status`)."""


class StepFailed(Exception):
    pass


@dataclass
class Held:
    """A request this engine holds: who gets its outputs, and how often it has resumed."""

    owner: str
    """The tokenizer instance that owns it."""
    copy: int
    """`resumes` of the copy admitted: an Admit of the same copy again is a duplicate."""
    resumes: int
    """Resumes so far, those before it came here and those after a worker died here."""


DISCONNECTED_POLL_S = 0.5
"""While NATS is away past a step's timeout, how often the master looks again (it must not spin)."""


@dataclass
class InFlight:
    """An iteration sent to the workers whose result has not been applied yet."""

    output: SchedulerOutput
    result: asyncio.Future[StepResult]
    started: float  # time.perf_counter() when it was scheduled
    data: bytes = b""
    """The step message, kept to send again after a reconnect."""


class EngineMaster:
    def __init__(self, config: EngineConfig, replica: str, nc: Bus, workers: WorkerGroup, *,
                 max_model_len: int, eos_token_ids: tuple[int, ...], step_timeout_s: float = 120.0) -> None:
        self.config, self.replica, self.nc, self.workers = config, replica, nc, workers
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.step_timeout_s = step_timeout_s
        self.incarnation = uuid.uuid4().hex[:12]
        self.scheduler = self._new_scheduler()
        self.telemetry = EngineTelemetry(nc, replica, self.scheduler)
        self.held: dict[str, Held] = {}
        self.recent_cancels: OrderedDict[str, FinishReason] = OrderedDict()
        self.last_admit_sequence = 0
        self.ready = False
        self.restarting = False
        """Its workers are being restarted after a failed step (`_recover`)."""
        self.steps, self.step_seconds, self.execute_seconds = 0, 0.0, 0.0
        self._status_sent_at = 0.0
        self._status_owed = False
        """An Admit's acknowledgement, for the loop to send right after the step the admitted requests join.
        Sent before it, the status woke admission, the tokenizers and the gateways (all decode every status)
        while that step had yet to leave: on a small machine they share the master's core, and a lone
        prompt's step left 0.45 ms later (benchmarks/README.md, 2026-12-05)."""
        self._heard_as: tuple[bool, str] | None = None
        """(ready, incarnation) of the last status on ENGINE_STATUS, the subject everyone hears."""
        self.pipeline_depth = config.parallel.pipeline_parallel_size
        self.max_in_flight = 2 if self.scheduler.async_scheduling else self.pipeline_depth
        """Iterations sent and not yet applied: one per pipeline stage, or under async scheduling the one
        the worker runs and the next, queued behind it."""
        self.iteration_log: deque[tuple[int, list[str], list[int]]] = deque(maxlen=ITERATION_LOG_LENGTH)
        """The latest iterations: (iteration, its requests, the iterations in flight when it was sent)."""
        self._wake = asyncio.Event()
        self._in_flight: deque[InFlight] = deque()
        self.max_batches_in_flight = 0
        self.outputs_sent: dict[str, ReplayLog] = {}
        """Per tokenizer instance: the messages sent to it, numbered, for replays."""
        self.admits_ahead: set[int] = set()
        """Admit sequences applied beyond `last_admit_sequence` (one before them was lost, or is late)."""
        self._bus_back_at = 0.0
        """time.perf_counter() of the last reconnect to NATS: step timeouts count from it."""

    def _new_scheduler(self) -> Scheduler:
        parallel = self.config.parallel
        return Scheduler.from_config(self.config.scheduler, self.config.cache, self.max_model_len,
                                     pipeline_depth=parallel.pipeline_parallel_size, world_size=parallel.world_size)

    async def start(self) -> None:
        kv = self.scheduler.kv_cache
        if kv.num_blocks * kv.block_size < self.max_model_len:  # vLLM refuses to start so; this serves the cache's
            log.warning("engine %s: the KV cache holds %d tokens, fewer than the context (%d): no request longer "
                        "than the cache can run (raise --kv-cache-tokens or lower --max-model-len)", self.replica,
                        kv.num_blocks * kv.block_size, self.max_model_len)
        await self.nc.subscribe(subjects.engine_admit(self.replica), cb=self.on_admit)
        await self.nc.subscribe(subjects.CANCEL, cb=self.on_cancel)
        await self.nc.subscribe(subjects.engine_result(self.replica), cb=self.on_result)
        await self.nc.subscribe(subjects.engine_replay(self.replica), cb=self.on_replay)
        await self.nc.subscribe(subjects.engine_resync(self.replica), cb=self.on_resync)
        on_reconnect(self.nc, self.on_reconnected)

    # ---- the loop ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self.workers.start()
            self.ready = True
            await self.publish_status()
            while not stop.is_set():
                if not self.scheduler.has_unfinished and not self._in_flight:
                    if self._status_owed:  # the admitted requests have already ended (an error, a cancel)
                        await self.publish_status()
                    if await self.workers.lost_a_worker(grace_s=0.0):  # restart now, not when a request comes
                        await self._recover(WorkerDied("a worker stopped"), while_idle=True)
                        continue
                    await self._idle()
                    continue
                try:
                    await self.step()
                except (StepFailed, WorkerDied) as exc:
                    await self._recover(exc)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
        self.ready = False
        await self.publish_status()

    async def _heartbeat(self) -> None:
        """The status every HEARTBEAT_S, also while the loop waits on a long step or a restart."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            if now - last > STALL_RESET_S:
                self.start_over(now - last)
            last = now
            self._prune_outputs()
            await self.publish_status(heartbeat=True)

    def start_over(self, silent_s: float) -> None:
        """After a stall others may have taken for death: drop every request without a word (their
        tokenizers resume them, seeing the new incarnation) and become a new incarnation."""
        log.error("engine %s: its heartbeat stalled for %.1f s; dropping %d requests (their tokenizers resume "
                  "them)", self.replica, silent_s, len(self.scheduler.requests))
        for rid in list(self.scheduler.requests):
            self.scheduler.finish(rid, FinishReason.ABORT)
        self.held.clear()
        self.incarnation = uuid.uuid4().hex[:12]
        self.last_admit_sequence = 0
        self.admits_ahead.clear()
        self.outputs_sent.clear()  # the new incarnation's streams start at 0

    async def step(self) -> None:
        """Fill the pipeline, then apply the oldest iteration's result (or, while the pipeline
        has room, return early when a new request arrives, so it can join at once)."""
        while len(self._in_flight) < self.max_in_flight:
            started = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                break
            await self._send(scheduler_output, started)
        if self._status_owed:
            await self.publish_status()
        if not self._in_flight:
            await self._idle(0.05)  # requests wait for room that in-flight work will free
            return
        oldest = self._in_flight[0]
        room = len(self._in_flight) < self.max_in_flight
        result = await self._wait(oldest, interruptible=room)
        if result is None:
            return
        self._in_flight.popleft()
        if result.error is not None or result.output is None:
            error = result.error or "worker returned no output"
            if self.config.parallel.world_size > 1 and await self.workers.lost_a_worker(grace_s=5.0):
                raise WorkerDied(f"a worker died ({error})")
            raise StepFailed(error)
        await self._finish_iteration(oldest.output, result, oldest.started)

    async def _send(self, scheduler_output: SchedulerOutput, started: float) -> None:
        future = asyncio.get_running_loop().create_future()
        data = Codec.encode(scheduler_output)
        self._in_flight.append(InFlight(scheduler_output, future, started, data))
        self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._in_flight))
        self.iteration_log.append((scheduler_output.iteration, [s.request_id for s in scheduler_output.scheduled],
                                   [f.output.iteration for f in self._in_flight]))
        await self.nc.publish(subjects.engine_step(self.replica), data)

    async def _wait(self, in_flight: InFlight, interruptible: bool) -> StepResult | None:
        """The result, or None when woken; the step timeout counts from the scheduling, or from NATS'
        return when it was away meanwhile (a step lost with it is sent again, not taken for a hang)."""
        while True:
            since = max(in_flight.started, self._bus_back_at)
            timeout = max(0.0, since + self.step_timeout_s - time.perf_counter())
            if not self.nc.is_connected:  # no result can come before NATS does: look again now and then
                timeout = max(timeout, DISCONNECTED_POLL_S)
            try:
                return await self._wait_once(in_flight, interruptible, timeout)
            except StepTimedOut:
                if self.nc.is_connected and self._bus_back_at <= since:
                    raise

    async def _wait_once(self, in_flight: InFlight, interruptible: bool, timeout: float) -> StepResult | None:
        if not interruptible:
            return await self.workers.wait(in_flight.result, timeout)
        self._wake.clear()
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            return await self.workers.wait(in_flight.result, timeout, interrupt=woken)
        finally:
            woken.cancel()

    async def _finish_iteration(self, scheduler_output: SchedulerOutput, result: StepResult, started: float) -> None:
        events = self.scheduler.update(scheduler_output, result.output)
        await self.publish_outputs(events)  # first: the tokens' way out is the latency users see
        self.telemetry.on_iteration(scheduler_output, result, events, started)
        self.steps += 1
        self.step_seconds += time.perf_counter() - started
        self.execute_seconds += result.execute_s
        freed = scheduler_output.preempted_request_ids or any(e.finished for e in events)
        if freed or time.monotonic() - self._status_sent_at >= ITERATION_STATUS_S:
            await self.publish_status()

    async def _idle(self, timeout_s: float = 0.5) -> None:
        """Until something wakes the loop (an admit, a result, a cancel), or `timeout_s`."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass

    async def _recover(self, exc: Exception, while_idle: bool = False) -> None:
        """A step failed, or a worker died between steps (`while_idle`). If a worker died (or hung), its KV is gone but the requests are not:
        they resume by recompute once Ray has restarted it, with the tokens they already have
        (a request that already resumed MAX_RESUMES times ends with an error instead). If the
        forward pass raised, every request on this engine ends with a clear error. Either way
        the worker processes are restarted (a process whose forward pass raised is not trusted:
        a CUDA error poisons its context, a half-written KV cache its state) and the engine
        serves again."""
        if while_idle:
            log.error("engine %s: %s while idle; restarting the workers", self.replica, exc)
        else:
            log.error("engine %s: step failed: %s", self.replica, exc)
        self.ready = False
        await self.publish_status()
        message = f"engine {self.replica} failed: {exc}"
        for lost in self._in_flight:
            lost.result.cancel()
        self._in_flight.clear()
        if isinstance(exc, WorkerDied):
            for rid in self.scheduler.preempt_all():
                self.held[rid].resumes += 1
            doomed = [rid for rid in self.scheduler.requests if self.held[rid].resumes > MAX_RESUMES]
        else:
            doomed = list(self.scheduler.requests)
        events = [e for rid in doomed if (e := self.scheduler.finish(rid, FinishReason.ERROR, message)) is not None]
        self.telemetry.on_finished(events)  # their spans end with the error, not as "cancelled"
        await self.publish_outputs(events)
        # The incarnation stays: this master still holds its requests and resumes them itself, and takes
        # the admits that arrive meanwhile (sent before its status said not ready, or sent again).
        self.restarting = True
        try:
            await self.workers.restart(hard=True)
        finally:
            self.restarting = False
        self.ready = True
        await self.publish_status()

    # ---- messages in ---------------------------------------------------------------------

    async def on_admit(self, msg: Msg) -> None:
        admit = admit_codec.decode(msg.data)
        if admit.incarnation and admit.incarnation != self.incarnation:
            return  # for the master this one replaced: its requests resume through their tokenizers
        if admit.sequence <= self.last_admit_sequence or admit.sequence in self.admits_ahead:
            await self.publish_status()  # a repeat (the status acknowledging it was lost, or late): echo again
            return
        self.telemetry.on_admit(admit.requests)
        errors: list[RequestOutput] = []
        for tokenized in admit.requests:
            error = self._add(tokenized)
            if error is not None:
                errors.append(error)
        self.admits_ahead.add(admit.sequence)
        while self.last_admit_sequence + 1 in self.admits_ahead:  # acknowledge only what all arrived
            self.last_admit_sequence += 1
            self.admits_ahead.discard(self.last_admit_sequence)
        self.telemetry.on_finished(errors)
        await self.publish_outputs(errors)
        if self.ready and len(self._in_flight) < self.max_in_flight:  # the loop sends a step at once
            self._status_owed = True
        else:  # no step leaves before an in-flight one returns (or the workers are back): acknowledge now
            await self.publish_status()
        self._wake.set()

    def _add(self, tokenized: TokenizedRequest) -> RequestOutput | None:
        rid, owner = tokenized.request_id, tokenized.tokenizer_instance
        held = self.held.get(rid)
        if held is not None and held.owner == owner and held.copy == tokenized.resumes:
            return None  # the same copy again (resubmitted to a restarted admission): it runs here already
        if held is not None:  # a newer copy (resumed by its owner, or by its client through another tokenizer)
            self.scheduler.finish(rid, FinishReason.ABORT)  # no event: the new copy's owner has taken over
        self.held[rid] = Held(owner, tokenized.resumes, tokenized.resumes)
        cancelled = self.recent_cancels.pop(rid, None)
        if cancelled is not None:  # the cancel overtook the admission
            return RequestOutput(rid, finish_reason=cancelled)
        if not self.ready and not self.restarting:
            return RequestOutput(rid, finish_reason=FinishReason.ERROR, error=f"engine {self.replica} is not ready")
        if tokenized.resumes > MAX_RESUMES:
            return RequestOutput(rid, finish_reason=FinishReason.ERROR,
                                 error=f"the engines serving this request failed {tokenized.resumes} times; giving up")
        request = Request(rid, tokenized.prompt_token_ids, tokenized.params, self.eos_token_ids,
                          priority=tokenized.priority, output_token_ids=list(tokenized.resume_token_ids),
                          cache_salt=tokenized.cache_salt)
        done = finished_before_resume(request, self.max_model_len)
        if done is not None:  # its last output was lost with the engine that made it
            return RequestOutput(rid, finish_reason=done)
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            return RequestOutput(rid, finish_reason=FinishReason.ERROR, error=str(exc))
        return None

    async def on_cancel(self, msg: Msg) -> None:
        cancel = cancel_codec.decode(msg.data)
        event = self.scheduler.finish(cancel.request_id, cancel.reason)
        if event is None:
            self.recent_cancels[cancel.request_id] = cancel.reason
            while len(self.recent_cancels) > RECENT_CANCELS:
                self.recent_cancels.popitem(last=False)
            return
        self.telemetry.on_finished([event])  # its span ends with its reason (abort, stop), not "cancelled"
        await self.publish_outputs([event])
        await self.publish_status()

    async def on_result(self, msg: Msg) -> None:
        result = result_codec.decode(msg.data)
        for in_flight in self._in_flight:
            if in_flight.output.iteration == result.iteration and not in_flight.result.done():
                in_flight.result.set_result(result)

    # ---- NATS away and back ------------------------------------------------------------------

    def on_reconnected(self) -> None:
        self._bus_back_at = time.perf_counter()
        asyncio.get_running_loop().create_task(self.resend_steps())

    async def on_resync(self, msg: Msg) -> None:
        resync = resync_codec.decode(msg.data)
        log.warning("engine %s: worker %d is back on NATS after iteration %d; sending %d iterations again",
                    self.replica, resync.rank, resync.last_iteration, len(self._in_flight))
        self._bus_back_at = time.perf_counter()
        await self.resend_steps()

    async def resend_steps(self) -> None:
        """The iterations in flight, in order, again: a worker runs the ones it missed and answers the
        others with the results it kept."""
        for in_flight in list(self._in_flight):
            if not in_flight.result.done():
                await self.nc.publish(subjects.engine_step(self.replica), in_flight.data)

    async def on_replay(self, msg: Msg) -> None:
        """A tokenizer missed some of the outputs sent to it: they go again, then the answer."""
        replay = replay_codec.decode(msg.data)
        sent = self.outputs_sent.get(replay.owner)
        if replay.incarnation != self.incarnation:
            missing = None
        elif sent is None:
            missing = [] if replay.from_seq == 0 else None
        else:
            missing = sent.since(replay.from_seq)
        for data in missing or ():
            await self.nc.publish(subjects.detok(replay.owner), data)
        if msg.reply:
            next_seq = sent.next_seq if sent is not None else 0
            await self.nc.publish(msg.reply, Codec.encode(OutputsReplayed(missing is not None, next_seq)))

    def _prune_outputs(self) -> None:
        """Old messages go; each stream's numbering stays (its tokenizer expects the next number)."""
        now = time.monotonic()
        for sent in self.outputs_sent.values():
            sent.prune(now)

    # ---- messages out --------------------------------------------------------------------

    async def publish_outputs(self, events: list[RequestOutput]) -> None:
        by_owner: dict[str, tuple[list[RequestOutput], list[int]]] = {}
        for event in events:
            held = self.held.get(event.request_id)
            if held is None:
                continue
            outputs, copies = by_owner.setdefault(held.owner, ([], []))
            outputs.append(event)
            copies.append(held.copy)
            if event.finish_reason is not None:
                del self.held[event.request_id]
        source = engine_source(self.replica, self.incarnation)
        now = time.monotonic()
        for owner, (outputs, copies) in by_owner.items():
            sent = self.outputs_sent.get(owner)
            if sent is None:
                sent = self.outputs_sent[owner] = ReplayLog(window_s=OUTPUTS_WINDOW_S, max_messages=MAX_OUTPUTS_KEPT)
            data = Codec.encode(IterationOutputs(outputs, source, sent.next_seq, copies))
            sent.append(data, now)
            await self.nc.publish(subjects.detok(owner), data)

    def status(self) -> EngineStatus:
        kv = self.scheduler.kv_cache
        waiting_blocks = sum(kv.blocks_needed(self.scheduler.policy.reservation(r, self.max_model_len))
                             for r in self.scheduler.waiting)
        return EngineStatus(
            replica=self.replica, incarnation=self.incarnation, ready=self.ready, block_size=kv.block_size,
            num_blocks=kv.num_blocks, admissible_blocks=max(0, kv.num_free_blocks - waiting_blocks),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            max_num_seqs=self.scheduler.max_num_seqs, max_model_len=self.max_model_len,
            last_admit_sequence=self.last_admit_sequence, iteration=self.scheduler.iteration,
            kv_used_blocks=kv.num_used_blocks, num_preemptions=self.scheduler.num_preemptions, steps=self.steps, step_seconds=self.step_seconds,
            execute_seconds=self.execute_seconds, pipeline_depth=self.pipeline_depth,
            max_batches_in_flight=self.max_batches_in_flight,
        )

    async def publish_status(self, heartbeat: bool = False) -> None:
        """The status on ENGINE_STATUS (everyone's) when it is the heartbeat or its readiness or incarnation
        changed; else on ENGINE_PROGRESS, which only admission needs (its acknowledgements, the KV it frees)."""
        self._status_sent_at, self._status_owed = time.monotonic(), False
        status = self.status()
        news = (status.ready, status.incarnation) != self._heard_as
        if heartbeat or news:
            self._heard_as = (status.ready, status.incarnation)
            await self.nc.publish(subjects.ENGINE_STATUS, Codec.encode(status))
        else:
            await self.nc.publish(subjects.ENGINE_PROGRESS, Codec.encode(status))


def finished_before_resume(request: Request, max_model_len: int) -> FinishReason | None:
    """Whether a resumed request's tokens already end it (the engine that made its last token died
    before saying so): the scheduler's stop rules, applied to that last token."""
    if not request.output_token_ids:
        return None
    last, params = request.output_token_ids[-1], request.params
    if last in params.stop_token_ids or (last in request.eos_token_ids and not params.ignore_eos):
        return FinishReason.STOP
    if len(request.output_token_ids) >= request.output_limit(max_model_len):
        return FinishReason.LENGTH
    return None
