"""The jobs service's dedupe logic, on an in-memory JetStream (milliseconds): a job runs once however
often JetStream delivers it. The real-NATS round trips are in tests/reliability (test_nats_cluster,
test_soak) and tests/deploy."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from nats.js.errors import NotFoundError

import services.jobs.service as jobs
from shared import subjects


class FakeJetStream:
    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}

    async def get_last_msg(self, stream: str, subject: str):
        if subject not in self.stored:
            raise NotFoundError()
        return SimpleNamespace(data=self.stored[subject])

    async def publish(self, subject: str, payload: bytes, headers=None):
        self.stored.setdefault(subject, payload)  # JetStream's Nats-Msg-Id window: a repeat stores nothing


class FakeNats:
    def __init__(self) -> None:
        self.js = FakeJetStream()

    def jetstream(self) -> FakeJetStream:
        return self.js


class Delivery:
    """One JetStream delivery of a job message, recording how it was answered."""

    def __init__(self, body: dict, msg_id: str | None = None, delivered: int = 1, stream_seq: int = 7) -> None:
        self.data = msgspec.json.encode(body)
        self.headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        self.metadata = SimpleNamespace(num_delivered=delivered, sequence=SimpleNamespace(stream=stream_seq))
        self.answers: list[str] = []
        self.nak_delays: list[float | None] = []

    async def ack(self) -> None:
        self.answers.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.answers.append("nak")
        self.nak_delays.append(delay)

    async def in_progress(self) -> None:
        self.answers.append("in_progress")


@pytest.fixture
def generations(monkeypatch) -> list[str]:
    """The request ids the service generated for; each generation takes a moment."""
    started: list[str] = []

    async def fake_generate(nc, body, timeout_s, idle_timeout_s, on_event=None):
        started.append(body["id"])
        await asyncio.sleep(0.02)
        events = [{"token_ids": [5, 6], "text": "ab", "finish_reason": "length", "prompt_token_ids": [1]}]
        for event in events:
            if on_event is not None:
                on_event(event)
        return events

    monkeypatch.setattr(jobs, "generate", fake_generate)
    return started


def test_a_job_delivered_twice_while_in_flight_runs_once_and_the_first_delivery_acks(generations):
    async def go():
        service = jobs.JobsService(FakeNats())
        first, again = Delivery({"prompt": "hi"}, msg_id="j1"), Delivery({"prompt": "hi"}, msg_id="j1", delivered=2)
        await asyncio.gather(service._handle(first), service._handle(again))
        return service, first, again

    service, first, again = asyncio.run(go())
    assert generations == ["j1~1"]
    assert first.answers == ["ack"] and again.answers == [], "the repeat is left to the delivery in flight"
    assert subjects.jobs_result("j1") in service.js.stored and not service.in_flight


def test_a_job_whose_result_is_stored_is_acked_without_generating_again(generations):
    async def go():
        service = jobs.JobsService(FakeNats())
        await service._handle(Delivery({"prompt": "hi"}, msg_id="j2"))
        late = Delivery({"prompt": "hi"}, msg_id="j2", delivered=3)  # redelivered after its ack was lost
        await service._handle(late)
        return late

    late = asyncio.run(go())
    assert generations == ["j2~1"] and late.answers == ["ack"]


def test_the_job_id_is_the_message_id_else_the_body_id_else_the_stream_sequence():
    service = jobs.JobsService(FakeNats())
    assert service.job_id(Delivery({"id": "body-id", "prompt": "x"}, msg_id="header-id")) == "header-id"
    assert service.job_id(Delivery({"id": "body-id", "prompt": "x"})) == "body-id"
    assert service.job_id(Delivery({"prompt": ""}, stream_seq=42)) == "seq-42"  # not a valid request: its seq


def test_a_malformed_job_gets_an_error_result_and_is_acked(generations):
    async def go():
        service = jobs.JobsService(FakeNats())
        bad = Delivery([1, 2], msg_id="j3")  # a JSON array, not an object
        await service._handle(bad)
        return service, bad

    service, bad = asyncio.run(go())
    result = msgspec.json.decode(service.js.stored[subjects.jobs_result("j3")])
    assert generations == [] and bad.answers == ["ack"]
    assert result["finish_reason"] == "error" and "malformed job" in result["error"]


@pytest.mark.parametrize("msg_id,body_id", [("a b", None), ("a.*", None), ("a..b", None), (None, "has space"),
                                            ("x" * 300, None)])
def test_a_job_whose_id_cannot_name_a_subject_gets_an_error_result_under_its_sequence_and_is_acked(
        generations, msg_id, body_id):
    """Its result subject would be `orca.v1.jobs.result.<id>`: NATS refuses such a subject, and the job was
    redelivered every 2 s for ever."""
    async def go():
        service = jobs.JobsService(FakeNats())
        body = {"prompt": "x", "max_tokens": 2, **({"id": body_id} if body_id else {})}
        delivery = Delivery(body, msg_id=msg_id, stream_seq=42)
        await service._handle(delivery)
        return service, delivery

    service, delivery = asyncio.run(go())
    assert generations == [] and delivery.answers == ["ack"]
    result = msgspec.json.decode(service.js.stored[subjects.jobs_result("seq-42")])
    assert result["finish_reason"] == "error" and "cannot name its result subject" in result["error"]
    assert list(service.js.stored) == [subjects.jobs_result("seq-42")]


def test_a_dotted_job_id_still_names_its_result():
    assert subjects.is_valid_tail("team.job-1") and subjects.is_valid_tail("j3")
