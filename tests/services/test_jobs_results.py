"""What the jobs service stores as a job's result, on an in-memory JetStream (milliseconds):

- a generation that ends with an error that passes (the final event's `retry`: no tokenizer or engine
  for a while, the admission queue full, a tokenizer shutting down) is no result: the job is nak'ed with
  a delay and runs again when JetStream hands it out again;
- a result has the shape of an `orca generate` output line (engine/batch_job.py `completion_record`):
  logprobs, tool_calls, and metrics with queue_s, ttft_s and latency_s.

The same on a real nats-server: tests/services/test_jobs_consumer.py."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

import services.jobs.service as jobs
from shared import subjects
from tests.services.test_jobs_logic import Delivery, FakeNats

NO_TOKENIZER = "no tokenizer service listened (NATS: no responders)"
ORCA_GENERATE_FIELDS = ["id", "prompt_token_ids", "token_ids", "text", "finish_reason", "stop_reason", "tool_calls",
                        "logprobs", "metrics"]
"""engine/batch_job.py `completion_record`'s keys, in its order, for a request with tools and logprobs that a
stop string ended."""


def logprob(token_id: int, value: float) -> dict:
    return {"token_id": token_id, "logprob": value, "top_logprobs": [{"token_id": token_id, "logprob": value}]}


CALL = {"id": "call_abc", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}, "type": "function"}
STREAM = [  # (seconds before it, event): a stream with logprobs and, on its final event, tool calls
    (0.03, {"id": "x", "token_ids": [], "text": "", "finish_reason": None, "seq": 0}),
    (0.03, {"id": "x", "token_ids": [5], "text": "a", "finish_reason": None, "logprobs": [logprob(5, -0.5)],
            "seq": 1}),
    (0.03, {"id": "x", "token_ids": [6], "text": "b", "finish_reason": "stop", "logprobs": [logprob(6, -1.5)],
            "stop_reason": "b", "tool_calls": [CALL], "usage": {"prompt_tokens": 2, "completion_tokens": 2},
            "prompt_token_ids": [1, 2], "seq": 2}),
]


def retry_error(message: str = NO_TOKENIZER) -> list:
    return [(0.0, {"id": "x", "token_ids": [], "text": "", "finish_reason": "error", "error": message,
                   "retry": True})]


@pytest.fixture
def script(monkeypatch) -> dict:
    """Request id (`<job>~<delivery>`) -> the events its generation gives; records the ids generated."""
    streams: dict = {"started": []}

    async def fake_generate(nc, body, timeout_s, idle_timeout_s, on_event=None):
        streams["started"].append(body["id"])
        events = []
        for delay, event in streams[body["id"]]:
            await asyncio.sleep(delay)
            events.append(event)
            if on_event is not None:
                on_event(event)
        return events

    monkeypatch.setattr(jobs, "generate", fake_generate)
    return streams


def stored(service, job_id: str) -> dict:
    return msgspec.json.decode(service.js.stored[subjects.jobs_result(job_id)])


@pytest.mark.parametrize("error", [NO_TOKENIZER, "no engine has been available for 60 s; retry later",
                                   "admission queue full", "shutting down; retry later"])
def test_an_error_that_passes_stores_no_result_and_the_job_runs_again_when_redelivered(script, error, caplog):
    script["t~1"] = retry_error(error)
    script["t~2"] = retry_error(error)
    script["t~3"] = STREAM

    async def go():
        service = jobs.JobsService(FakeNats())
        deliveries = [Delivery({"prompt": "hi", "logprobs": 1}, msg_id="t", delivered=n) for n in (1, 2, 3)]
        for delivery in deliveries:
            await service._handle(delivery)
            if delivery.metadata.num_delivered < 3:
                assert subjects.jobs_result("t") not in service.js.stored, "a passing error is no result"
        return service, deliveries

    with caplog.at_level(logging.WARNING, logger="orca.jobs"):
        service, (first, second, third) = asyncio.run(go())
    assert script["started"] == ["t~1", "t~2", "t~3"]
    assert first.answers == ["nak"] and second.answers == ["nak"] and third.answers == ["ack"]
    assert 1.5 <= first.nak_delays[0] <= 2.5 and 3.0 <= second.nak_delays[0] <= 5.0, "a delay, not a hot loop"
    assert stored(service, "t")["finish_reason"] == "stop" and not service.in_flight
    deferred = [r for r in caplog.records if "deferred" in r.getMessage()]
    assert len(deferred) == 1 and error in deferred[0].getMessage(), "logged once per job"


def test_an_error_that_does_not_pass_is_still_the_result_while_one_that_passes_is_not(script):
    script["bad~1"] = [(0.0, {"id": "x", "token_ids": [], "text": "", "finish_reason": "error",
                              "error": "prompt is 9000 tokens; max_model_len is 2048"})]
    script["later~1"] = retry_error()

    async def go():
        service = jobs.JobsService(FakeNats())
        bad, later = Delivery({"prompt": "x"}, msg_id="bad"), Delivery({"prompt": "x"}, msg_id="later")
        await asyncio.gather(service._handle(bad), service._handle(later))
        return service, bad, later

    service, bad, later = asyncio.run(go())
    assert bad.answers == ["ack"] and "max_model_len" in stored(service, "bad")["error"]
    assert later.answers == ["nak"] and list(service.js.stored) == [subjects.jobs_result("bad")]


def test_a_job_failing_so_on_the_consumers_last_delivery_stores_the_error(script):
    """With no max_deliver (the consumer's default) a job is handed out again for as long as it takes;
    an operator's max_deliver ends it with its error as the result on the last delivery, not with none."""
    script["m~2"] = retry_error()
    script["m~3"] = retry_error()

    async def go():
        service = jobs.JobsService(FakeNats())
        service.max_deliver = 3
        second, last = Delivery({"prompt": "x"}, msg_id="m", delivered=2), Delivery({"prompt": "x"}, msg_id="m",
                                                                                     delivered=3)
        await service._handle(second)
        await service._handle(last)
        return service, second, last

    service, second, last = asyncio.run(go())
    assert second.answers == ["nak"] and last.answers == ["ack"]
    result = stored(service, "m")
    assert result["finish_reason"] == "error" and NO_TOKENIZER in result["error"] and "max_deliver" in result["error"]


def test_the_delay_before_a_deferred_job_runs_again_grows_and_is_bounded():
    delays = [jobs.retry_delay_s(n) for n in range(1, 40)]
    assert 1.5 <= delays[0] <= 2.5 and all(d <= jobs.MAX_RETRY_DELAY_S for d in delays)
    assert min(delays[10:]) >= 0.75 * jobs.MAX_RETRY_DELAY_S


def test_a_result_has_the_fields_of_an_orca_generate_line_logprobs_tool_calls_and_metrics(script):
    script["r~1"] = STREAM
    body = {"messages": [{"role": "user", "content": "weather?"}], "logprobs": 1, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}

    async def go():
        service = jobs.JobsService(FakeNats())
        await service._handle(Delivery(body, msg_id="r"))
        return service

    service = asyncio.run(go())
    raw = service.js.stored[subjects.jobs_result("r")]
    result = msgspec.json.decode(raw)
    assert list(result) == ORCA_GENERATE_FIELDS, raw
    assert (result["prompt_token_ids"], result["token_ids"], result["text"]) == ([1, 2], [5, 6], "ab")
    assert result["logprobs"] == [logprob(5, -0.5), logprob(6, -1.5)]  # shared.api.EventLogprob, as orca generate
    assert result["tool_calls"] == [CALL]
    metrics = result["metrics"]
    assert list(metrics) == ["queue_s", "ttft_s", "latency_s"] and metrics["queue_s"] is None
    assert 0.05 <= metrics["ttft_s"] < metrics["latency_s"], metrics  # the first token came after 2 events


def test_a_jobs_prompt_logprobs_are_those_of_its_first_event():
    first = {"id": "x", "token_ids": [5], "text": "a", "finish_reason": None,
             "prompt_logprobs": [logprob(2, -0.25)]}
    final = {"id": "x", "token_ids": [6], "text": "b", "finish_reason": "length", "prompt_token_ids": [1, 2]}
    result = msgspec.json.decode(msgspec.json.encode(jobs.job_result("x", [first, final], {})))
    assert result["prompt_logprobs"] == [logprob(2, -0.25)] and "prompt_logprobs" not in msgspec.json.decode(
        msgspec.json.encode(jobs.job_result("x", [final], {})))


def test_a_job_asking_for_logprobs_that_gets_no_token_has_an_empty_list_and_no_ttft(script):
    script["e~1"] = [(0.0, {"id": "x", "token_ids": [], "text": "", "finish_reason": "error", "error": "boom"})]

    async def go():
        service = jobs.JobsService(FakeNats())
        await service._handle(Delivery({"prompt": "x", "logprobs": 0}, msg_id="e"))
        return service

    result = stored(asyncio.run(go()), "e")
    assert result["logprobs"] == [] and result["error"] == "boom" and result["text"] == ""
    assert result["metrics"]["ttft_s"] is None and result["metrics"]["latency_s"] >= 0
