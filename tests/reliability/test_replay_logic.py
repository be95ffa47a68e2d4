"""Numbered streams and replays (issue #20), in milliseconds, with in-memory buses: what lets every
stream arrive whole through a NATS restart or a cluster failover. The engine's outputs to a
tokenizer, the tokenizer's events to a client, the master's steps to its workers and admission's
admits to an engine are each numbered; a gap, a repeat or a reconnect is handled on the receiving
side. On real servers: test_broker_restart.py, test_nats_cluster.py and the soak."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from core.admission import AdmissionQueue
from core.batch import RunnerOutput, SchedulerOutput, StepResult
from core.streams import Arrival, ReplayLog, arrival
from services.engine.worker_actor import Worker
from services.gateway.resume import StreamWatch
from shared import subjects
from shared.api import GenerateEvent, GenerateRequest
from shared.codec import Codec
from shared.config import EngineConfig, ModelConfig
from shared.messages import AdmissionStatus, Admit, IterationOutputs, OutputsReplay, OutputsReplayed, Placed
from shared.outputs import FinishReason, RequestOutput
from tests.reliability.test_recovery_logic import admit, request, running_master, status, stopped, until_ended
from tests.reliability.test_recovery_shells import FakeNats, msg, settle, submissions, tokenizer_with_request


def test_a_consumer_takes_the_next_message_drops_a_repeat_and_sees_a_gap():
    assert [arrival(3, seq) for seq in (3, 2, 0, 4, 9)] == [
        Arrival.NEXT, Arrival.REPEAT, Arrival.REPEAT, Arrival.GAP, Arrival.GAP]


def test_a_replay_log_gives_every_kept_message_from_a_seq_and_none_once_one_is_gone():
    log = ReplayLog(first_seq=5, window_s=10.0, max_messages=3)
    for i in range(4):
        assert log.append(f"m{i}".encode(), now=float(i)) == 5 + i
    assert log.next_seq == 9
    assert log.since(6) == [b"m1", b"m2", b"m3"] and log.since(8) == [b"m3"] and log.since(9) == []
    assert log.since(5) is None, "beyond max_messages: dropped"
    log.prune(now=12.5)
    assert log.since(7) is None and log.since(8) == [b"m3"], "older than the window: dropped"
    assert log.next_seq == 9, "the numbering goes on"


# ---- engine master ----------------------------------------------------------------------------------

def detok_messages(bus, owner: str = "tok") -> list[bytes]:
    return [data for subject, data in bus.published if subject == subjects.detok(owner)]


def test_the_master_numbers_its_messages_per_tokenizer_and_sends_again_what_one_missed():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("a", max_tokens=6), request("b", owner="tok2", max_tokens=3))
        await until_ended(bus, "a")
        sent = detok_messages(bus)
        asked = SimpleNamespace(data=Codec.encode(OutputsReplay("tok", master.incarnation, 2)), reply="_INBOX.ask")
        await master.on_replay(asked)
        again = detok_messages(bus)[len(sent):]
        stale = SimpleNamespace(data=Codec.encode(OutputsReplay("tok", "an-older-one", 0)), reply="_INBOX.ask2")
        await master.on_replay(stale)
        answers = [(s, Codec(OutputsReplayed).decode(d)) for s, d in bus.published if s.startswith("_INBOX.ask")]
        await stopped(stop, task, master)
        return sent, again, answers, detok_messages(bus, "tok2")

    sent, again, answers, other = asyncio.run(go())
    seqs = [Codec(IterationOutputs).decode(d).seq for d in sent]
    assert seqs == list(range(len(sent))) and len(sent) >= 6
    assert [Codec(IterationOutputs).decode(d).seq for d in other][:1] == [0], "a stream per tokenizer"
    assert again == sent[2:], "the same messages, from the seq asked for"
    assert answers == [("_INBOX.ask", OutputsReplayed(True, len(sent))), ("_INBOX.ask2", OutputsReplayed(False, len(sent)))]


def test_the_master_acknowledges_only_admits_that_all_arrived_and_runs_a_repeated_one_once():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("second", max_tokens=3), sequence=2)  # admit 1 was lost on the way
        acked_with_a_gap = master.status().last_admit_sequence
        await admit(master, request("first", max_tokens=3), sequence=1)  # ... and comes again
        await until_ended(bus, "first", "second")
        await admit(master, request("second", max_tokens=3), sequence=2)  # a repeat after it ended
        await asyncio.sleep(0.05)
        await stopped(stop, task, master)
        return acked_with_a_gap, master.status().last_admit_sequence, bus.outputs(), master.scheduler.requests

    acked_with_a_gap, acked, outputs, left = asyncio.run(go())
    assert acked_with_a_gap == 0 and acked == 2
    assert len(outputs["second"][0]) == 3 and outputs["second"][1][0] == FinishReason.LENGTH
    assert left == {}, "the repeat did not run the request again"


def test_admission_sends_an_unacknowledged_admit_again_until_a_status_acknowledges_it():
    queue = AdmissionQueue(max_queue_len=10)
    queue.on_status(status(ack=0), now=0.0)
    queue.submit(request("r"))
    [(replica, sequence, sent)] = queue.decide(now=0.0)
    assert queue.unacknowledged(now=0.5, older_than_s=1.0) == []
    assert queue.unacknowledged(now=1.2, older_than_s=1.0) == [(replica, sequence, sent)]
    assert queue.unacknowledged(now=1.5, older_than_s=1.0) == [], "sent again at 1.2: not yet due"
    queue.on_status(status(ack=sequence), now=1.6)
    assert queue.unacknowledged(now=9.0, older_than_s=1.0) == []


# ---- workers ------------------------------------------------------------------------------------------

class CountingRunner:
    def __init__(self) -> None:
        self.ran: list[int] = []
        self.requests: dict = {}

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        self.ran.append(step.iteration)
        return RunnerOutput({"r": step.iteration})


def test_a_worker_runs_each_iteration_once_in_order_and_answers_a_repeat_with_the_kept_result():
    worker = Worker(EngineConfig(model=ModelConfig(model="unused")), "nats://unused", "0", max_model_len=64)
    worker.runner = CountingRunner()

    def step(iteration: int) -> SchedulerOutput:
        return SchedulerOutput(iteration, [], [], [])

    def iterations(answers: list[bytes]) -> list[int]:
        return [Codec(StepResult).decode(a).iteration for a in answers]

    assert iterations(worker.take(step(7))) == [7], "after a (re)start, any iteration is the first"
    assert iterations(worker.take(step(7))) == [7], "a repeat: the kept result, not a second run"
    assert worker.take(step(9)) == [], "8 is missing: 9 waits for it"
    assert iterations(worker.take(step(8))) == [8, 9]
    assert worker.runner.ran == [7, 8, 9]


# ---- tokenizer ----------------------------------------------------------------------------------------

def outputs_message(seq: int, *tokens: int, reason: FinishReason | None = None, source: str = "0/i1"):
    outputs = [RequestOutput("r1", (t,)) for t in tokens[:-1]]
    outputs.append(RequestOutput("r1", (tokens[-1],), finish_reason=reason))
    return msg(IterationOutputs(outputs, source, seq))


def test_the_tokenizer_numbers_a_requests_events_and_replays_them_to_its_client_also_after_the_end():
    async def go():
        service, nc = await tokenizer_with_request()
        await service.on_outputs(outputs_message(0, 5))
        await settle()
        await service.on_outputs(outputs_message(1, 6))
        await settle()
        await service.on_outputs(outputs_message(2, 7, reason=FinishReason.LENGTH))
        await settle()
        first = nc.events()
        await service.on_replay(msg(json.dumps({"id": "r1", "from_seq": 1}).encode(), "_INBOX.replay"))
        await service.on_replay(msg(json.dumps({"id": "nobody", "from_seq": 0}).encode(), "_INBOX.nobody"))
        await service.recovery.stop()
        return first, nc.events()[len(first):], nc.events("_INBOX.replay"), nc.events("_INBOX.nobody")

    first, again, answer, nobody = asyncio.run(go())
    assert [e.get("seq", 0) for e in first] == [0, 1, 2] and first[-1]["finish_reason"] == "length"
    assert again == first[1:]
    assert answer == [{"id": "r1", "held": True, "next_seq": 3}] and nobody == []


def test_the_tokenizer_asks_the_engine_for_what_it_missed_drops_repeats_and_keeps_the_order():
    async def go():
        service, nc = await tokenizer_with_request()
        nc.answers[subjects.engine_replay("0")] = Codec.encode(OutputsReplayed(True, 3))
        await service.on_outputs(outputs_message(0, 5))
        await service.on_outputs(outputs_message(2, 7))  # 1 was lost: dropped, and asked for
        await settle()
        asked = [Codec(OutputsReplay).decode(d) for d in nc.on(subjects.engine_replay("0"))]
        await service.on_outputs(outputs_message(1, 6))  # the replay
        await service.on_outputs(outputs_message(2, 7))
        await service.on_outputs(outputs_message(1, 6))  # a late original: a repeat
        await service.on_outputs(outputs_message(3, 8, reason=FinishReason.LENGTH))
        await settle()
        await service.recovery.stop()
        return asked, nc.events()

    asked, events = asyncio.run(go())
    assert asked == [OutputsReplay("tok", "i1", 1)]
    assert [t for e in events for t in e["token_ids"]] == [5, 6, 7, 8] and events[-1]["finish_reason"] == "length"


def test_after_a_reconnect_the_tokenizer_asks_each_engine_holding_its_requests_from_the_next_seq():
    async def go():
        service, nc = await tokenizer_with_request()
        nc.answers[subjects.engine_replay("0")] = Codec.encode(OutputsReplayed(True, 1))
        await service.on_outputs(outputs_message(0, 5))
        await settle()
        service.on_reconnected()
        await settle()
        await service.recovery.stop()
        return [Codec(OutputsReplay).decode(d) for d in nc.on(subjects.engine_replay("0"))], nc.events()

    asked, events = asyncio.run(go())
    assert asked == [OutputsReplay("tok", "i1", 1)]
    assert all(e["finish_reason"] is None for e in events), "a reconnect ends nothing"


def test_a_tokenizer_whose_engine_no_longer_has_the_missed_outputs_ends_those_requests_with_a_clear_error():
    async def go():
        service, nc = await tokenizer_with_request()
        nc.answers[subjects.engine_replay("0")] = Codec.encode(OutputsReplayed(False, 900))
        await service.on_outputs(outputs_message(0, 5))
        await service.on_outputs(outputs_message(7, 6))
        for _ in range(3):
            await settle()
        await service.recovery.stop()
        return nc.events(), service.active

    events, active = asyncio.run(go())
    assert events[-1]["finish_reason"] == "error" and "no longer had" in events[-1]["error"]
    assert active == {}


def test_a_refusal_at_the_door_is_numbered_as_the_resending_client_expects():
    async def go():
        service, nc = await tokenizer_with_request()
        await service.on_generate(msg(json.dumps({"id": "bad", "prompt": "", "resume_seq": 4}).encode(), "_INBOX.bad"))
        await service.recovery.stop()
        return nc.events("_INBOX.bad")

    [event] = asyncio.run(go())
    assert event["finish_reason"] == "error" and event["seq"] == 4


# ---- gateway --------------------------------------------------------------------------------------------

def test_the_gateway_takes_events_in_order_drops_a_repeat_and_asks_for_a_replay_at_a_gap(monkeypatch):
    monkeypatch.setattr("services.gateway.resume.PROBE_TIMEOUT_S", 0.05)

    async def go():
        nc = FakeNats()
        nc.holds = True
        watch = StreamWatch(nc, lambda rid, why: None)
        watch.watch(GenerateRequest(id="g1", prompt="hi", max_tokens=8), "_INBOX.gw.g1")
        taken = [watch.take("g1", GenerateEvent("g1", [4], "a", None, seq=0)),
                 watch.take("g1", GenerateEvent("g1", [4], "a", None, seq=0)),
                 watch.take("g1", GenerateEvent("g1", [6], "c", None, seq=2))]
        for _ in range(5):
            await settle()
        replays = [json.loads(d) for d in nc.on(subjects.GENERATE_REPLAY)]
        taken.append(watch.take("g1", GenerateEvent("g1", [5], "b", None, seq=1)))
        return taken, replays, watch.watched["g1"].token_ids, nc.on(subjects.GENERATE)

    taken, replays, tokens, resent = asyncio.run(go())
    assert taken == [True, False, False, True]
    assert replays == [{"id": "g1", "from_seq": 1}] and resent == [], "held: replayed, not resent"
    assert tokens == [4, 5]


def test_an_admit_sent_again_after_its_master_restarted_is_dropped_by_the_new_one():
    async def go():
        master, bus, _, stop, task = await running_master()
        stale = Admit(7, [request("stale", max_tokens=3)], incarnation="the-master-before")
        await master.on_admit(SimpleNamespace(data=Codec.encode(stale)))
        await admit(master, request("fresh", max_tokens=3), sequence=1)
        await until_ended(bus, "fresh")
        await stopped(stop, task, master)
        return master.status().last_admit_sequence, master.admits_ahead, bus.outputs()

    acked, ahead, outputs = asyncio.run(go())
    assert acked == 1 and ahead == set() and "stale" not in outputs


def test_after_a_reconnect_the_tokenizer_submits_again_what_no_engine_is_known_to_hold():
    async def go():
        service, nc = await tokenizer_with_request()
        await service.on_generate(msg(json.dumps({"id": "r2", "prompt_token_ids": [4], "max_tokens": 3}).encode(),
                                      "client.inbox.r2"))
        await service.on_outputs(outputs_message(0, 5))  # r1 is on engine 0/i1 (its Placed note was lost)
        before = len(nc.on(subjects.ADMISSION_SUBMIT))
        service.on_reconnected()
        for _ in range(3):
            await settle()
        await service.recovery.stop()
        return [s.request_id for s in submissions(nc)[before:]]

    assert asyncio.run(go()) == ["r2"]


def test_only_the_engine_holding_a_request_has_its_outputs_counted():
    from core.placements import Placements

    placements = Placements()
    placements.submitted(request("r"))
    assert placements.output_from("r", "0/i1"), "the first engine heard from holds it (its Placed was lost)"
    assert not placements.output_from("r", "1/j1"), "a second copy on another replica does not count"
    placements.placed(Placed("1", "j1", ["r"]), now=0.0)  # ... nor does its placement
    assert placements.engine_of("r") == "0/i1"
    placements.submitted(request("r", resumes=1))  # resumed: 0/i1 is left behind
    assert not placements.output_from("r", "0/i1") and placements.output_from("r", "1/j1")


def test_a_request_resumed_onto_the_engine_it_was_judged_gone_from_counts_its_new_copys_outputs():
    """The tokenizer judged 0/i1 gone (no status for 3 s: only NATS was away) and resumed the request;
    admission placed the new copy on 0/i1 again, alive all along. Its outputs count; the old copy's do not."""
    from core.placements import Placements

    placements = Placements()
    placements.submitted(request("r"))
    placements.on_engine_status(status("0", "i1"), now=0.0)
    placements.placed(Placed("0", "i1", ["r"]), now=0.0)
    resumed = [r for now in (0.25 * i for i in range(1, 17)) for r in placements.tick(now).resume]
    assert resumed == ["r"]
    placements.submitted(request("r", resumes=1))
    placements.on_engine_status(status("0", "i1"), now=4.5)
    placements.placed(Placed("0", "i1", ["r"]), now=4.5)
    assert not placements.output_from("r", "0/i1", copy=0), "a late output of the old copy"
    assert placements.output_from("r", "0/i1", copy=1), "the new copy, on the same engine"
    assert not placements.output_from("r", "1/j1", copy=1), "the same copy on a second engine"
    assert not placements.output_from("r", "0/i1"), "an engine that does not say which copy: left behind"


def test_an_observer_back_from_its_own_outage_gives_everyone_a_full_expiry_again():
    from core.liveness import Heartbeats
    from core.placements import Placements

    beats = Heartbeats(3.0)
    beats.beat("0", "a", now=0.0)
    beats.restart_clocks(now=10.0)  # it heard nobody from 0 to 10 s: its own connection was down
    assert beats.expire(10.25) == [] and beats.expire(12.75) == [] and beats.alive("0", "a")
    assert beats.expire(13.25) == [("0", "a")], "still silent a full expiry after the observer came back"

    placements = Placements(no_admission_timeout_s=30.0)
    placements.submitted(request("queued"))
    placements.on_admission_status(AdmissionStatus(queue_len=1, max_queue_len=8, num_engines_ready=1), now=0.0)
    placements.on_reconnected(now=40.0)
    assert placements.tick(40.25).give_up == [], "the admission's silence was the observer's own"
    assert placements.tick(70.5).give_up == ["queued"]


def test_a_tokenizer_cut_off_from_nats_judges_no_engine_and_resumes_nothing_when_it_is_back():
    async def go():
        service, nc = await tokenizer_with_request()
        recovery = service.recovery
        await recovery._on_engine_status(msg(status("0", "i1")))
        await recovery._on_placed(msg(Placed("0", "i1", ["r1"])))
        before = len(submissions(nc))
        nc.is_connected = False
        now = time.monotonic()
        for step in range(1, 41):  # 10 s without NATS
            await recovery.tick(now + 0.25 * step)
        nc.is_connected = True
        service.on_reconnected()
        await recovery.tick(time.monotonic() + 0.25)
        during = submissions(nc)[before:]
        await service.on_outputs(msg(IterationOutputs([RequestOutput("r1", (9,), finish_reason=FinishReason.LENGTH)],
                                                      "0/i1", 0, [0])))
        await settle()
        await recovery.stop()
        return during, nc.events()

    during, events = asyncio.run(go())
    assert during == [], "nothing resumed: the engine was never judged"
    assert events[-1]["finish_reason"] == "length" and events[-1]["token_ids"] == [9]


def test_the_master_says_which_copy_each_output_comes_from():
    async def go():
        master, bus, _, stop, task = await running_master()
        await admit(master, request("first", max_tokens=2, resumes=0), sequence=1)
        await admit(master, request("again", max_tokens=2, resumes=2), sequence=2)
        await until_ended(bus, "first")
        await until_ended(bus, "again")
        await stopped(stop, task, master)
        return [Codec(IterationOutputs).decode(d) for d in detok_messages(bus)]

    copies = {o.request_id: c for message in asyncio.run(go()) for o, c in zip(message.outputs, message.copies,
                                                                              strict=True)}
    assert copies == {"first": 0, "again": 2}


def test_a_placement_on_an_incarnation_already_replaced_or_never_heard_from_resumes_instead_of_waiting():
    from core.placements import Placements

    placements = Placements(expiry_s=3.0)
    placements.submitted(request("late"))
    placements.submitted(request("silent"))
    placements.on_engine_status(status("0", "i2"), now=0.0)  # 0 restarted as i2 ...
    assert placements.placed(Placed("0", "i1", ["late"]), now=0.1) == ["late"], "... then i1's Placed came"
    assert placements.placed(Placed("1", "j1", ["silent"]), now=0.1) == [] and placements.engine_of("silent") == "1/j1"
    assert [r for now in (1.0, 2.0, 3.0) for r in placements.tick(now).resume] == []
    assert placements.tick(3.5).resume == ["silent"], "1/j1 never spoke: what it was given resumes"


def test_held_is_answered_for_a_request_that_just_ended_as_replay_is():
    """A client that missed the last event asks; silence would make it send the finished request again."""
    async def go():
        service, nc = await tokenizer_with_request()
        await service.on_outputs(outputs_message(0, 5, reason=FinishReason.LENGTH))
        await settle()
        for rid, reply in (("r1", "_INBOX.held"), ("nobody", "_INBOX.nobody")):
            await service.recovery._on_held(msg(json.dumps({"id": rid}).encode(), reply))
        await service.recovery.stop()
        return nc.events("_INBOX.held"), nc.events("_INBOX.nobody")

    held, nobody = asyncio.run(go())
    assert held == [{"id": "r1", "held": True}] and nobody == []
