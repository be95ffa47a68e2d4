"""The shells of recovery, each with an in-memory NATS connection, in milliseconds: the tokenizer
resumes what a lost engine held and resubmits what a restarted admission lost, answers "held?",
continues a stream its client resent; the gateway's stream watch resends a stream nobody holds and
leaves a held one alone. On real processes: test_chaos.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec

from services.gateway.resume import StreamWatch
from services.tokenizer.recovery import GAVE_UP
from services.tokenizer.service import TokenizerService
from shared import subjects
from shared.api import GenerateEvent, GenerateRequest
from shared.codec import Codec
from shared.messages import (MAX_RESUMES, AdmissionStatus, EngineStatus, IterationOutputs, Placed, TokenizedRequest,
                             TokenizerStatus)
from shared.outputs import FinishReason, RequestOutput

REPLY = "client.inbox.r1"


class FakeTokenizer:
    """Token t decodes to `<t>`."""

    eos_token_ids = (2,)

    def decode(self, token_ids) -> str:
        return "".join(f"<{t}>" for t in token_ids)


class FakeSub:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def next_msg(self, timeout: float):
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def unsubscribe(self) -> None:
        return None


class FakeNats:
    """Records publishes; subscriptions made with `cb` are kept by subject, those without get a
    FakeSub; a publish to GENERATE_HELD is answered by `holder(request_id)` when it says so."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []
        self.subs: dict[str, FakeSub] = {}
        self.holds = False
        self.answers: dict[str, bytes] = {}
        """Subject -> the answer a request on it gets (on its own reply subject)."""
        self.is_closed, self.is_connected = False, True

    def new_inbox(self) -> str:
        return f"_INBOX.fake{len(self.subs)}"

    async def subscribe(self, subject: str, queue: str = "", cb=None, max_msgs: int = 0):
        if cb is not None:
            return None
        self.subs[subject] = FakeSub()
        return self.subs[subject]

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        self.published.append((subject, payload, reply))
        if subject in (subjects.GENERATE_HELD, subjects.GENERATE_REPLAY) and self.holds and reply in self.subs:
            self.subs[reply].queue.put_nowait(SimpleNamespace(data=b'{"id": "x", "held": true}', headers=None))
        if subject in self.answers and reply in self.subs:
            self.subs[reply].queue.put_nowait(SimpleNamespace(data=self.answers[subject], headers=None))

    async def flush(self, timeout: float = 0) -> None:
        return None

    def on(self, subject: str) -> list[bytes]:
        return [data for s, data, _ in self.published if s == subject]

    def events(self, reply: str = REPLY) -> list[dict]:
        return [json.loads(data) for s, data, _ in self.published if s == reply]


def submissions(nc: FakeNats) -> list[TokenizedRequest]:
    return [Codec(TokenizedRequest).decode(d) for d in nc.on(subjects.ADMISSION_SUBMIT)]


def engine_status(incarnation: str, replica: str = "0") -> SimpleNamespace:
    status = EngineStatus(replica=replica, incarnation=incarnation, ready=True, block_size=16, num_blocks=10,
                          admissible_blocks=10, num_running=1, num_waiting=0, max_num_seqs=4, max_model_len=64,
                          last_admit_sequence=1, iteration=1, kv_used_blocks=1)
    return SimpleNamespace(data=Codec.encode(status))


def msg(data, reply: str = "") -> SimpleNamespace:
    return SimpleNamespace(data=data if isinstance(data, bytes) else Codec.encode(data), reply=reply, headers=None)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def tokenizer_with_request(body: dict | None = None) -> tuple[TokenizerService, FakeNats]:
    nc = FakeNats()
    service = TokenizerService(nc, FakeTokenizer(), vocab_size=100, instance="tok")
    await service.start()
    request = {"id": "r1", "prompt_token_ids": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, **(body or {})}
    await service.on_generate(msg(json.dumps(request).encode(), REPLY))
    return service, nc


async def streamed(service: TokenizerService, *tokens: int, reason: FinishReason | None = None,
                   source: str = "0/i1") -> None:
    outputs = [RequestOutput("r1", (t,)) for t in tokens[:-1]]
    outputs.append(RequestOutput("r1", (tokens[-1],), finish_reason=reason))
    await service.on_outputs(msg(IterationOutputs(outputs, source)))
    await settle()


def test_the_tokenizer_resumes_a_request_whose_engine_restarted_with_the_tokens_it_sent():
    async def go():
        service, nc = await tokenizer_with_request()
        recovery = service.recovery
        await recovery._on_engine_status(engine_status("i1"))
        await recovery._on_placed(msg(Placed("0", "i1", ["r1"])))
        await streamed(service, 5, 6, 7)
        await recovery._on_engine_status(engine_status("i2"))  # the master restarted: i1 is gone
        await streamed(service, 4, source="0/i1")  # a late output of the lost copy does not count
        await streamed(service, 8, reason=FinishReason.LENGTH, source="0/i2")  # ... the new copy goes on
        await recovery.stop()
        return submissions(nc), nc.events()

    sent, events = asyncio.run(go())
    assert [s.resume_token_ids for s in sent] == [[], [5, 6, 7]] and [s.resumes for s in sent] == [0, 1]
    assert [t for e in events for t in e["token_ids"]] == [5, 6, 7, 8]
    assert "".join(e["text"] for e in events) == "<5><6><7><8>" and events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_a_request_that_lost_its_engine_once_too_often_ends_with_a_clear_error():
    async def go():
        service, nc = await tokenizer_with_request()
        recovery = service.recovery
        copy = recovery.placements.tracked["r1"].tokenized
        recovery.placements.submitted(msgspec.structs.replace(copy, resumes=MAX_RESUMES))
        await recovery._on_engine_status(engine_status("i1"))
        await recovery._on_placed(msg(Placed("0", "i1", ["r1"])))
        await recovery._on_engine_status(engine_status("i2"))
        await recovery.stop()
        return nc.events(), service.active, nc.on(subjects.ABORT)

    events, active, aborts = asyncio.run(go())
    assert events[-1]["finish_reason"] == "error" and events[-1]["error"] == GAVE_UP.format(MAX_RESUMES + 1)
    assert "retry" not in events[-1], "a request that took its engine down twice may do it again: not to be retried"
    assert "prompt_token_ids" not in events[-1], "an error event carries no prompt (it may be what was wrong)"
    assert "r1" not in active and aborts, "ended here, and aborted wherever a copy may still run"


def test_what_a_restarted_admission_had_queued_is_submitted_again_as_it_was():
    async def go():
        service, nc = await tokenizer_with_request()
        recovery = service.recovery
        await recovery._on_admission_status(msg(AdmissionStatus(1, 10, 1, "adm1")))
        await recovery._on_admission_status(msg(AdmissionStatus(0, 10, 1, "adm2")))
        await recovery.stop()
        return submissions(nc)

    sent = asyncio.run(go())
    assert len(sent) == 2 and sent[0] == sent[1], "the same copy: a new admission dedupes, an engine holding it too"


def test_a_submission_nobody_received_waits_for_an_admission_then_goes_again():
    async def go():
        service, nc = await tokenizer_with_request()
        token = next(iter(service.submissions))
        await service.on_bounce(SimpleNamespace(subject=f"{service.bounce_inbox}.{token}", data=b"", headers=None))
        waiting = "r1" in service.active and not nc.events()
        await service.recovery._on_admission_status(msg(AdmissionStatus(0, 10, 1, "adm")))
        await service.recovery.stop()
        return waiting, submissions(nc)

    waiting, sent = asyncio.run(go())
    assert waiting, "no error at once: an admission is probably restarting"
    assert len(sent) == 2


def test_the_tokenizer_answers_held_only_for_what_it_holds_and_sends_its_heartbeat():
    async def go():
        service, nc = await tokenizer_with_request()
        await service.recovery._on_held(msg(b'{"id": "r1"}', reply="probe.1"))
        await service.recovery._on_held(msg(b'{"id": "nobody"}', reply="probe.2"))
        await service.recovery.publish_status()
        await service.recovery.stop()
        return nc

    nc = asyncio.run(go())
    assert nc.on("probe.1") and not nc.on("probe.2")
    assert Codec(TokenizerStatus).decode(nc.on(subjects.TOKENIZER_STATUS)[-1]) == TokenizerStatus("tok", 1)


def test_a_stream_resent_by_its_client_continues_after_what_it_has_and_a_resend_to_a_holder_only_reattaches():
    async def go():
        service, nc = await tokenizer_with_request({"resume_token_ids": [5, 6]})
        first_submission = submissions(nc)[-1]
        await service.on_generate(msg(json.dumps({"id": "r1", "prompt_token_ids": [1, 2, 3], "max_tokens": 8,
                                                  "resume_token_ids": [5, 6]}).encode(), "client.inbox.new"))
        await streamed(service, 7, reason=FinishReason.LENGTH)
        await service.recovery.stop()
        return first_submission, submissions(nc), nc.events(), nc.events("client.inbox.new")

    first, sent, old_reply, new_reply = asyncio.run(go())
    assert first.resume_token_ids == [5, 6] and len(sent) == 1, "the resend to the holder is no new request"
    assert old_reply == []
    assert new_reply[-1]["token_ids"] == [7] and new_reply[-1]["text"] == "<7>"
    assert new_reply[-1]["usage"]["completion_tokens"] == 3


def test_another_request_under_a_held_id_cannot_take_its_stream_over():
    """Ids are the users' own: a different request that reuses one, resume fields and all, is refused,
    and the stream stays with the client that holds it."""
    async def go():
        service, nc = await tokenizer_with_request()
        await service.on_generate(msg(json.dumps({"id": "r1", "prompt_token_ids": [9], "max_tokens": 2,
                                                  "resume_token_ids": []}).encode(), "client.inbox.other"))
        await streamed(service, 7, reason=FinishReason.LENGTH)
        await service.recovery.stop()
        return submissions(nc), nc.events(), nc.events("client.inbox.other")

    sent, holder, other = asyncio.run(go())
    assert len(sent) == 1
    assert [e["token_ids"] for e in holder] == [[7]] and holder[-1]["finish_reason"] == "length"
    assert len(other) == 1 and other[0]["finish_reason"] == "error" and "already in use" in other[0]["error"]


def test_the_gateway_resends_a_silent_stream_nobody_holds_and_leaves_a_held_one_alone(monkeypatch):
    monkeypatch.setattr("services.gateway.resume.PROBE_TIMEOUT_S", 0.05)

    async def go():
        nc = FakeNats()
        ended: list[tuple[str, str]] = []
        watch = StreamWatch(nc, lambda rid, why: ended.append((rid, why)))
        request = GenerateRequest(id="g1", prompt="hi", max_tokens=8)
        watch.watch(request, "_INBOX.gw.g1")
        assert watch.take("g1", GenerateEvent("g1", [4, 5], "ab", None))
        nc.holds = True
        await watch._check("g1", watch.watched["g1"])
        held_resends = nc.on(subjects.GENERATE)
        nc.holds = False
        await watch._check("g1", watch.watched["g1"])
        resent = [(json.loads(d), r) for s, d, r in nc.published if s == subjects.GENERATE]
        resending = watch.resending("g1")
        assert watch.take("g1", GenerateEvent("g1", [6], "c", "length", seq=1))
        return held_resends, resent, resending, watch.watched, ended

    held_resends, resent, resending, watched, ended = asyncio.run(go())
    assert held_resends == [], "a tokenizer holds it: nothing to do"
    [(body, reply)] = resent
    assert (body["id"], body["prompt"], body["resume_token_ids"], body["resume_seq"], reply) == (
        "g1", "hi", [4, 5], 1, "_INBOX.gw.g1")
    assert resending and watched == {} and ended == []


def test_a_drain_cut_short_ends_what_is_in_flight_at_once_with_the_shutting_down_error():
    """`orca serve` cuts the drain short (a second SIGTERM) when its engines died with Ray: nothing
    in flight can finish, so waiting out --drain-timeout would only delay the error."""
    async def go():
        service, nc = await tokenizer_with_request()
        cut_short = asyncio.Event()
        draining = asyncio.create_task(service.drain(60.0, cut_short=cut_short))
        await asyncio.sleep(0.2)
        still_waiting = not draining.done() and "r1" in service.active
        cut_short.set()
        await asyncio.wait_for(draining, 2)
        await service.recovery.stop()
        return still_waiting, nc.events(), service.active

    still_waiting, events, active = asyncio.run(go())
    assert still_waiting, "without the cut, the drain waits for the request in flight"
    assert events[-1]["finish_reason"] == "error" and "shutting down" in events[-1]["error"] and not active
    assert events[-1]["retry"] is True, "served elsewhere or later, it would succeed: a job goes back to JetStream"
