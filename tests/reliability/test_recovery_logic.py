"""The recovery rules on their own, in milliseconds: heartbeats and their expiry (admission, the
tokenizer's placements, the gateway's /health), and the engine master's resume rules, driven
through an in-memory bus and worker group. The same rules on real processes: test_chaos.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec

from core.admission import AdmissionQueue
from core.batch import RunnerOutput, SchedulerOutput, StepResult
from core.liveness import STALLED_OBSERVER_S, Heartbeats
from core.placements import Placements
from services.admission.service import AdmissionService
from services.engine.master import EngineMaster
from services.engine.worker_group import WorkerDied
from services.gateway.engine_client import EngineClient
from services.gateway.status import StatusBoard
from services.tokenizer.recovery import Recovery
from shared import subjects
from shared.codec import Codec
from shared.config import CacheConfig, EngineConfig, ModelConfig
from shared.messages import (MAX_RESUMES, Admit, AdmissionStatus, Cancel, EngineStatus, IterationOutputs, Placed,
                             TokenizedRequest, TokenizerStatus)
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from tests.fake_nats import RecordingNats

STATUS_SUBJECTS = {subjects.ENGINE_STATUS, subjects.ENGINE_PROGRESS}

EXPIRY = 3.0


def status(replica="0", incarnation="a", ready=True, ack=0) -> EngineStatus:
    return EngineStatus(replica=replica, incarnation=incarnation, ready=ready, block_size=1, num_blocks=100,
                        admissible_blocks=100, num_running=0, num_waiting=0, max_num_seqs=8, max_model_len=64,
                        last_admit_sequence=ack, iteration=0, kv_used_blocks=0)


def request(rid: str, owner="tok", max_tokens=10, resume=(), resumes=0) -> TokenizedRequest:
    return TokenizedRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True), owner, 0.0,
                            resume_token_ids=list(resume), resumes=resumes)


# ---- heartbeats ------------------------------------------------------------------------------------

def test_a_silent_name_expires_after_the_expiry_and_a_new_incarnation_replaces_the_old_at_once():
    beats = Heartbeats(EXPIRY)
    assert beats.beat("0", "a", now=0.0) is None
    for now in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0):  # the observer looks every half second
        assert beats.expire(now) == []
    assert beats.expire(3.5) == [("0", "a")] and not beats.alive("0", "a")
    assert beats.beat("0", "a", now=4.0) is None, "back: alive again (nothing is banned for ever)"
    assert beats.beat("0", "b", now=4.1) == "a", "a restart: the old incarnation is gone without waiting"


def test_an_observer_that_was_itself_stalled_judges_nobody_until_it_has_read_its_backlog():
    beats = Heartbeats(EXPIRY)
    beats.beat("0", "a", now=0.0)
    assert beats.expire(0.5) == []
    assert beats.expire(0.5 + STALLED_OBSERVER_S + 5.0) == [], "its own loop was blocked: statuses may be queued"
    beats.beat("0", "a", now=6.6)  # the queued status, read now
    assert beats.expire(6.8) == []


# ---- admission -------------------------------------------------------------------------------------

def test_admission_stops_routing_to_an_engine_the_moment_it_expires_and_counts_it_again_when_it_speaks():
    q = AdmissionQueue(10, expiry_s=EXPIRY)
    q.on_status(status(), now=0.0)
    q.submit(request("r0"))
    assert [(r, [x.request_id for x in reqs]) for r, _, reqs in q.decide()] == [("0", ["r0"])]
    q.on_status(status(ack=1), now=1.0)
    assert [q.expire(now) for now in (1.5, 2.5, 3.5, 4.0)] == [[], [], [], []]
    assert q.expire(4.5) == ["0"] and q.engines == {}, "hung (SIGSTOP) or dead: silent for longer than the expiry"
    q.submit(request("r1"))
    assert q.decide() == [], "nothing is routed to an engine that is gone"
    q.on_status(status(incarnation="b"), now=6.0)  # restarted
    assert [(r, [x.request_id for x in reqs]) for r, _, reqs in q.decide()] == [("0", ["r1"])]


def test_requests_waiting_for_an_engine_end_once_none_has_been_alive_for_the_timeout():
    q = AdmissionQueue(10, expiry_s=EXPIRY, no_engine_timeout_s=20.0)
    q.submit(request("r0"))
    assert q.starved(0.0) == [] and q.starved(19.0) == []
    q.on_status(status(ready=False), now=19.5)  # an engine restarting: alive, so the clock stops
    assert q.starved(30.0) == []
    q.expire(30.0)
    q.expire(30.4)
    assert q.engines == {} and q.starved(31.0) == []
    assert [r.request_id for r in q.starved(51.5)] == ["r0"] and not q.queue


# ---- the tokenizer's placements ------------------------------------------------------------------------

def test_requests_resume_when_their_engine_expires_or_restarts_and_only_those():
    p = Placements(expiry_s=EXPIRY)
    for rid in ("a", "b", "c", "queued"):
        p.submitted(request(rid))
    p.placed(Placed("0", "i1", ["a", "b"]), now=0.0)
    p.placed(Placed("1", "j1", ["c"]), now=0.0)
    assert p.on_engine_status(status("0", "i1"), now=0.0) == [] and p.on_engine_status(status("1", "j1"), 0.0) == []
    assert p.on_engine_status(status("1", "j2"), now=1.0) == ["c"], "replica 1 restarted: what it held is gone"
    p.tick(1.0)
    p.tick(2.5)
    assert sorted(p.tick(3.5).resume) == ["a", "b"], "replica 0 went silent"
    assert p.tick(4.0).resume == []


def test_what_a_dead_admission_had_queued_is_resubmitted_and_a_bounced_submission_waits_then_gives_up():
    p = Placements(expiry_s=EXPIRY, no_admission_timeout_s=30.0)
    p.submitted(request("placed"))
    p.submitted(request("queued"))
    p.placed(Placed("0", "i1", ["placed"]), now=0.0)
    assert p.on_admission_status(AdmissionStatus(0, 10, 1, "adm1"), now=0.0) == []
    assert p.on_admission_status(AdmissionStatus(0, 10, 1, "adm1"), now=1.0) == []
    assert p.on_admission_status(AdmissionStatus(0, 10, 1, "adm2"), now=2.0) == ["queued"], "a new admission"
    p.submitted(request("bounced"))
    p.bounced("bounced", now=3.0)
    assert p.on_admission_status(AdmissionStatus(0, 10, 1, "adm2"), now=3.5) == ["bounced"]
    p.submitted(request("bounced"))  # resubmitted ... and bounced again: no admission for a long time
    p.bounced("bounced", now=4.0)
    assert p.tick(33.0).give_up == [] and "bounced" in p.tick(34.5).give_up
    p.keep_only({"placed"})
    assert list(p.tracked) == ["placed"]


# ---- the gateway's /health -------------------------------------------------------------------------------

def test_health_is_503_while_admission_an_engine_or_a_tokenizer_is_silent_and_200_once_all_speak(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("services.gateway.status.time.monotonic", lambda: clock[0])
    board = StatusBoard(expiry_s=EXPIRY)
    board.on_admission(AdmissionStatus(0, 10, 1, "adm"))
    board.on_engine(status())
    assert board.health()[0] == 503 and board.health()[1]["reason"] == "no tokenizer service is answering"
    board.on_tokenizer(TokenizerStatus("t", 0))
    assert board.health() == (200, {"status": "ok", "num_engines_ready": 1, "num_tokenizers": 1, "queue_len": 0,
                                    "max_queue_len": 10})
    clock[0] += 2.0
    board.on_admission(AdmissionStatus(0, 10, 1, "adm"))
    board.on_tokenizer(TokenizerStatus("t", 0))
    clock[0] += 1.5  # the engine's last status is 3.5 s old: dead or hung
    code, body = board.health()
    assert code == 503 and body["num_engines_ready"] == 0 and body["reason"] == "no engine is ready"
    board.on_engine(status(incarnation="b"))
    assert board.health()[0] == 200
    board.on_tokenizer(TokenizerStatus("t", 0, draining=True))
    assert board.health()[0] == 503


# ---- the engine master, with an in-memory bus and workers ------------------------------------------------

def token_at(position: int) -> int:
    """The fake model: the token sampled at a position depends on the position alone, so a request
    resumed from its tokens must continue exactly as an uninterrupted one would."""
    return 10 + position % 50


class FakeBus(RecordingNats):
    """An in-memory NATS connection; a step message is answered (through `on_result`) by the fake
    model, unless the workers are set to die."""

    def __init__(self) -> None:
        super().__init__()
        self.master: EngineMaster | None = None

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        await super().publish(subject, payload, reply, headers)
        if subject.endswith(".step"):
            step = Codec(SchedulerOutput).decode(payload)
            sampled = {s.request_id: token_at(s.num_computed_tokens + s.num_new_tokens)
                       for s in step.scheduled if s.samples}
            result = StepResult(step.iteration, RunnerOutput(sampled))
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(self.master.on_result(SimpleNamespace(data=Codec.encode(result)))))

    def outputs(self, owner: str = "tok") -> dict[str, list]:
        """Per request: its tokens, and its final (reason, error) if it ended."""
        seen: dict[str, list] = {}
        for data in self.on(f"orca.v1.detok.{owner}"):
            for out in Codec(IterationOutputs).decode(data).outputs:
                entry = seen.setdefault(out.request_id, [[], None])
                entry[0] += out.new_token_ids
                if out.finish_reason is not None:
                    entry[1] = (out.finish_reason, out.error)
        return seen


class FakeWorkers:
    """A WorkerGroup whose workers die in the steps numbered in `die_at` (counted from 1)."""

    def __init__(self) -> None:
        self.die_at: set[int] = set()
        self.steps = 0
        self.restarts = 0
        self.dead = False
        """A worker died between steps (its `serve` call ended): lost_a_worker says so until a restart."""

    async def start(self) -> None:
        return None

    async def wait(self, result, timeout_s, interrupt=None):
        self.steps += 1
        if self.steps in self.die_at:
            raise WorkerDied("a worker stopped (test)")
        waiting = [result] + ([interrupt] if interrupt is not None else [])
        done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        if interrupt is not None and interrupt in done:
            return None
        raise WorkerDied("no result")

    async def restart(self, hard: bool) -> None:
        self.restarts += 1
        self.dead = False

    async def lost_a_worker(self, grace_s: float) -> bool:
        return self.dead


async def running_master(workers: FakeWorkers | None = None
                         ) -> tuple[EngineMaster, FakeBus, FakeWorkers, asyncio.Event, asyncio.Task]:
    bus, workers = FakeBus(), workers or FakeWorkers()
    config = EngineConfig(model=ModelConfig(model="unused"), cache=CacheConfig(kv_cache_tokens=1024))
    master = EngineMaster(config, "0", bus, workers, max_model_len=256, eos_token_ids=(0,), step_timeout_s=5.0)
    bus.master = master
    stop = asyncio.Event()
    task = asyncio.create_task(master.run(stop))
    await asyncio.sleep(0)
    return master, bus, workers, stop, task


async def admit(master: EngineMaster, *requests: TokenizedRequest, sequence: int = 1) -> None:
    await master.on_admit(SimpleNamespace(data=Codec.encode(Admit(sequence, list(requests)))))


async def until_ended(bus: FakeBus, *ids: str, timeout_s: float = 5.0) -> dict[str, list]:
    async def ended() -> None:
        while not all(bus.outputs().get(r, [None, None])[1] for r in ids):
            await asyncio.sleep(0.001)
    await asyncio.wait_for(ended(), timeout_s)
    return bus.outputs()


async def stopped(stop: asyncio.Event, task: asyncio.Task, master: EngineMaster | None = None) -> None:
    stop.set()
    if master is not None:
        master._wake.set()  # out of its idle wait now
    await asyncio.wait_for(task, 5)


def test_a_resumed_request_continues_after_its_tokens_exactly_as_an_uninterrupted_one():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("whole", max_tokens=12))
        first = (await until_ended(bus, "whole"))["whole"]
        await admit(master, request("resumed", max_tokens=12, resume=first[0][:5], resumes=1), sequence=2)
        second = (await until_ended(bus, "resumed"))["resumed"]
        await stopped(stop, task, master)
        return first, second, master

    first, second, master = asyncio.run(go())
    assert first[1] == (FinishReason.LENGTH, None) and len(first[0]) == 12
    assert second[0] == first[0][5:], "only the tokens after those it already has, the same ones"
    assert second[1] == (FinishReason.LENGTH, None)
    assert master.held == {} and master.scheduler.kv_cache.num_used_blocks == 0


def test_an_admitted_requests_cache_salt_is_the_schedulers_to_key_its_prefix_with():
    async def go():
        master, bus, _, stop, task = await running_master()
        salted = msgspec.structs.replace(request("salted", max_tokens=200), cache_salt="tenant-a")
        await admit(master, salted, request("plain", max_tokens=200))
        salts = {rid: r.cache_salt for rid, r in master.scheduler.requests.items()}
        await stopped(stop, task, master)
        return salts
    assert asyncio.run(go()) == {"salted": "tenant-a", "plain": None}


def test_a_request_past_the_resume_limit_ends_with_a_clear_error_and_worker_deaths_count_toward_it():
    async def go():
        master, bus, workers, stop, task = await running_master()
        workers.die_at = {5}
        await admit(master, request("over", resume=[10, 11], resumes=MAX_RESUMES + 1))
        await admit(master, request("near", max_tokens=50, resumes=MAX_RESUMES), sequence=2)
        outs = await until_ended(bus, "over", "near")
        await stopped(stop, task, master)
        return outs, workers.restarts

    outs, restarts = asyncio.run(go())
    reason, error = outs["over"][1]
    assert reason == FinishReason.ERROR and f"failed {MAX_RESUMES + 1} times" in error
    assert outs["near"][1][0] == FinishReason.ERROR and "a worker stopped" in outs["near"][1][1]
    assert 0 < len(outs["near"][0]) < 50 and restarts == 1, "it ran until the worker died"


def test_a_request_below_the_limit_survives_a_worker_death_with_every_token_once():
    async def go():
        master, bus, workers, stop, task = await running_master()
        workers.die_at = {10}
        await admit(master, request("r", max_tokens=30))
        outs = await until_ended(bus, "r")
        await stopped(stop, task, master)
        return outs["r"], workers.restarts, master.scheduler.num_preemptions

    (tokens, final), restarts, preemptions = asyncio.run(go())
    assert restarts == 1 and preemptions == 1, "the worker died in the middle of the request"
    assert final == (FinishReason.LENGTH, None)
    assert tokens == [token_at(3 + i) for i in range(30)], "resumed by recompute: no token twice, none missing"


def test_the_same_copy_admitted_twice_runs_once_and_a_newer_copy_replaces_the_old():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("dup", max_tokens=40))
        await admit(master, request("dup", max_tokens=40), sequence=2)  # resubmitted to a restarted admission
        once = len(master.scheduler.requests)
        await admit(master, request("dup", owner="tok2", max_tokens=40), sequence=3)  # its client resumed elsewhere
        owner = master.held["dup"].owner

        async def ended() -> None:
            while bus.outputs("tok2").get("dup", [None, None])[1] is None:
                await asyncio.sleep(0.001)
        await asyncio.wait_for(ended(), 5)
        await stopped(stop, task, master)
        return once, owner, bus.outputs(), bus.outputs("tok2")

    once, owner, old, new = asyncio.run(go())
    assert once == 1 and owner == "tok2"
    assert old.get("dup", [[], None])[1] is None, "the replaced copy's owner hears no end it did not ask for"
    assert new["dup"][1] == (FinishReason.LENGTH, None) and len(new["dup"][0]) == 40


def test_a_master_that_finds_its_heartbeat_stalled_drops_its_requests_and_becomes_a_new_incarnation():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("r", max_tokens=200))
        before = master.incarnation
        master.start_over(silent_s=2.5)
        after = master.incarnation
        await asyncio.sleep(0.05)
        await stopped(stop, task, master)
        return before, after, master, bus

    before, after, master, bus = asyncio.run(go())
    assert before != after and not master.scheduler.requests and not master.held
    assert bus.outputs().get("r", [[], None])[1] is None, "no end: its tokenizer resumes it on the new incarnation"
    assert master.scheduler.kv_cache.num_used_blocks == 0


def test_a_resumed_request_whose_last_token_already_ended_it_ends_at_once():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("done", max_tokens=3, resume=[10, 11, 12], resumes=1))
        outs = await until_ended(bus, "done")
        await stopped(stop, task, master)
        return outs["done"]

    tokens, final = asyncio.run(go())
    assert tokens == [] and final == (FinishReason.LENGTH, None)


def test_a_cancel_that_overtakes_its_admit_ends_the_request_before_it_runs_and_frees_nothing_twice():
    async def go():
        master, bus, workers, stop, task = await running_master()
        await master.on_cancel(SimpleNamespace(data=Codec.encode(Cancel("early", FinishReason.ABORT))))
        await admit(master, request("early", max_tokens=40), request("other", max_tokens=5))
        outs = await until_ended(bus, "early", "other")
        await stopped(stop, task, master)
        return outs, master, workers

    outs, master, workers = asyncio.run(go())
    assert outs["early"] == [[], (FinishReason.ABORT, None)], "ended with no token: it never ran"
    assert outs["other"][1] == (FinishReason.LENGTH, None) and len(outs["other"][0]) == 5
    assert "early" not in master.scheduler.requests and master.scheduler.kv_cache.num_used_blocks == 0


def test_an_admit_is_acknowledged_right_after_the_step_it_joins_and_at_once_when_no_step_can_leave():
    """The status that acknowledges an Admit wakes admission: it goes out after the admitted prompt's
    step, not before it, but never waits for a step that cannot leave now."""
    async def go():
        master, bus, _, stop, task = await running_master()
        await asyncio.sleep(0.01)
        bus.published.clear()
        await admit(master, request("lone", max_tokens=3))
        await until_ended(bus, "lone")
        sent = [s for s, _ in bus.published]
        up_to_the_ack = sent[:sent.index(subjects.ENGINE_PROGRESS) + 1]
        master.ready = False  # restarting its workers: no step will come
        bus.published.clear()
        await admit(master, request("refused"), sequence=2)
        acknowledged_at_once = [(s, Codec(EngineStatus).decode(data).last_admit_sequence)
                                for s, data in bus.published if s in STATUS_SUBJECTS]
        master.ready = True
        await stopped(stop, task, master)
        return up_to_the_ack, acknowledged_at_once

    up_to_the_ack, acknowledged_at_once = asyncio.run(go())
    assert up_to_the_ack[0] == "orca.v1.engine.0.step" and up_to_the_ack[-1] == subjects.ENGINE_PROGRESS
    assert not STATUS_SUBJECTS & set(up_to_the_ack[:-1])
    assert [sequence for _, sequence in acknowledged_at_once] == [2]


def test_only_the_heartbeat_and_news_of_readiness_or_incarnation_reach_every_service():
    """Statuses between heartbeats (acknowledgements, KV freed) go to admission alone: on a small machine
    each one woke every tokenizer and gateway, on the cores the next step's messages need."""
    async def go():
        master, bus, _, stop, task = await running_master()
        await asyncio.sleep(0.01)
        started = [s for s, _ in bus.published if s in STATUS_SUBJECTS]
        bus.published.clear()
        await admit(master, request("a", max_tokens=3))
        await until_ended(bus, "a")
        serving = [s for s, _ in bus.published if s in STATUS_SUBJECTS]
        bus.published.clear()
        await master.publish_status(heartbeat=True)
        master.start_over(silent_s=10.0)
        await master.publish_status()
        await stopped(stop, task, master)
        return started, serving, [s for s, _ in bus.published if s in STATUS_SUBJECTS]

    started, serving, later = asyncio.run(go())
    assert started == [subjects.ENGINE_STATUS], "ready: news for everyone"
    assert serving and set(serving) == {subjects.ENGINE_PROGRESS}, "acknowledgements and freed KV: admission's"
    assert later[:2] == [subjects.ENGINE_STATUS, subjects.ENGINE_STATUS], "a heartbeat, then a new incarnation"
    assert later[-1] == subjects.ENGINE_STATUS, "stopping: no longer ready"


def test_admission_hears_every_engine_status_and_tokenizers_and_gateways_only_the_heartbeats():
    async def go():
        admission_bus, tokenizer_bus, gateway_bus = RecordingNats(), RecordingNats(), RecordingNats()
        admission = AdmissionService(admission_bus, max_queue_len=8)
        await admission.start()
        await admission.stop()
        recovery = Recovery(SimpleNamespace(nc=tokenizer_bus, instance="tok"))
        await recovery.start()
        await recovery.stop()
        gateway = EngineClient(gateway_bus)
        await gateway.start()
        gateway._watching.cancel()
        return admission_bus.subscribed, tokenizer_bus.subscribed, gateway_bus.subscribed

    admission, tokenizer, gateway = asyncio.run(go())
    assert {subjects.ENGINE_STATUS, subjects.ENGINE_PROGRESS} <= set(admission)
    for heard in (tokenizer, gateway):
        assert subjects.ENGINE_STATUS in heard and subjects.ENGINE_PROGRESS not in heard


def test_a_master_waiting_for_a_result_while_nats_is_away_looks_again_twice_a_second_not_in_a_loop():
    """Past the step timeout with the bus down, each wait timed out at once and the loop spun a core."""
    from services.engine.master import InFlight
    from services.engine.worker_group import StepTimedOut

    class SilentWorkers(FakeWorkers):
        async def wait(self, result, timeout_s, interrupt=None):
            self.steps += 1
            try:
                return await asyncio.wait_for(asyncio.shield(result), timeout_s)
            except asyncio.TimeoutError:
                raise StepTimedOut("no result (test)") from None

    async def go():
        bus, workers = FakeBus(), SilentWorkers()
        config = EngineConfig(model=ModelConfig(model="unused"), cache=CacheConfig(kv_cache_tokens=1024))
        master = EngineMaster(config, "0", bus, workers, max_model_len=256, eos_token_ids=(0,), step_timeout_s=0.1)
        bus.is_connected = False
        result = asyncio.get_running_loop().create_future()
        in_flight = InFlight(None, result, time.perf_counter() - 10)  # its timeout long past
        waiting = asyncio.create_task(master._wait(in_flight, interruptible=False))
        await asyncio.sleep(1.2)
        looks = workers.steps
        bus.is_connected, master._bus_back_at = True, time.perf_counter()  # back: the step timeout counts again
        result.set_result("the result")
        return looks, await asyncio.wait_for(waiting, 5)

    looks, got = asyncio.run(go())
    assert 2 <= looks <= 4, f"{looks} looks in 1.2 s"
    assert got == "the result"


def test_an_admit_that_arrives_while_the_workers_restart_waits_for_them_and_runs():
    """Admission may send it before the status saying `not ready` reaches it (or send one again)."""
    class SlowRestart(FakeWorkers):
        def __init__(self) -> None:
            super().__init__()
            self.restarting, self.release = asyncio.Event(), asyncio.Event()

        async def restart(self, hard: bool) -> None:
            self.restarting.set()
            await self.release.wait()
            await super().restart(hard)

    async def go():
        master, bus, workers, stop, task = await running_master(SlowRestart())
        workers.die_at = {3}
        await admit(master, request("before", max_tokens=6))
        await asyncio.wait_for(workers.restarting.wait(), 5)
        await admit(master, request("during", max_tokens=4), sequence=2)
        workers.release.set()
        outs = await until_ended(bus, "before", "during")
        await stopped(stop, task, master)
        return outs

    outs = asyncio.run(go())
    assert outs["during"][1] == (FinishReason.LENGTH, None) and len(outs["during"][0]) == 4
    assert outs["before"][1] == (FinishReason.LENGTH, None), "resumed after the worker died"


def test_admission_cut_off_from_nats_keeps_routing_to_its_engines_and_gives_each_a_full_expiry_once_back():
    async def go():
        bus = RecordingNats()
        admission = AdmissionService(bus, max_queue_len=8)
        await admission.on_status(SimpleNamespace(data=Codec.encode(status("0", "i1"))))
        now = time.monotonic()
        bus.is_connected = False
        await admission.check_engines(now + 10.0)
        during = sorted(admission.queue.engines)
        bus.is_connected = True
        admission.on_reconnected()
        await asyncio.sleep(0)
        back = time.monotonic()
        await admission.check_engines(back + 0.25)
        after = sorted(admission.queue.engines)
        for step in range(2, 15):  # looking every 0.25 s, as it does
            await admission.check_engines(back + 0.25 * step)
        return during, after, sorted(admission.queue.engines)

    during, after, silent = asyncio.run(go())
    assert during == ["0"] and after == ["0"], "its own outage is not the engine's death"
    assert silent == [], "an engine still silent a full expiry after the reconnect is gone"


def test_admission_marks_the_errors_that_pass_as_worth_a_retry():
    """A full queue and a long wait for any engine pass: the tokenizer's final event says retry (a job then
    goes back to JetStream instead of keeping the error as its result). A request no engine can serve does not."""
    async def go():
        bus = RecordingNats()
        admission = AdmissionService(bus, max_queue_len=1, no_engine_timeout_s=5.0)
        for rid in ("queued", "full"):
            await admission.on_submit(SimpleNamespace(data=Codec.encode(request(rid))))
        now = time.monotonic()
        await admission.check_engines(now)  # the wait for any engine starts
        await admission.check_engines(now + 6.0)
        outputs = [o for data in bus.on(subjects.detok("tok")) for o in Codec(IterationOutputs).decode(data).outputs]
        return {o.request_id: (o.finish_reason, o.retry, o.error) for o in outputs}

    ended = asyncio.run(go())
    assert ended["full"][:2] == (FinishReason.ERROR, True) and "full" in ended["full"][2]
    assert ended["queued"][:2] == (FinishReason.ERROR, True) and "no engine" in ended["queued"][2]


def test_a_request_that_ends_in_its_first_iteration_still_counts_its_queue_time():
    """The master publishes an iteration's outputs before it tells the telemetry of the iteration: ending
    the spans there lost every request that finished at once (max_tokens=1) from the queue-time metric."""
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("one", max_tokens=1), request("two", max_tokens=3))
        await until_ended(bus, "one", "two")
        await stopped(stop, task, master)
        return sum(master.telemetry.snapshot().request_queue_time.counts)

    assert asyncio.run(go()) == 2


def test_a_worker_that_dies_while_the_engine_is_idle_is_restarted_before_any_request_needs_it():
    """Before, an idle master learnt of the death only when the next request's step failed: that
    request waited for the whole restart, and /health said 200 meanwhile."""
    async def go():
        master, bus, workers, stop, task = await running_master()
        await asyncio.sleep(0.01)
        workers.dead = True
        deadline = time.monotonic() + 2.0
        while workers.restarts == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        restarted = workers.restarts
        statuses = [Codec(EngineStatus).decode(d).ready for d in bus.on(subjects.ENGINE_STATUS)]
        await admit(master, request("after", max_tokens=4))
        outs = await until_ended(bus, "after")
        await stopped(stop, task, master)
        return restarted, statuses, outs, workers.steps

    restarted, statuses, outs, steps = asyncio.run(go())
    assert restarted == 1, "an idle master restarts a dead worker within its idle wait (0.5 s)"
    assert False in statuses and statuses[-1] is True, "not ready while restarting, ready again after"
    assert outs["after"][1] == (FinishReason.LENGTH, None) and steps > 0
