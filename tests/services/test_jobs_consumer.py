"""The jobs consumer's ack wait (`--jobs-ack-wait`) on a real nats-server: the durable consumer outlives
the service, so a service started with another value must change the consumer's, or the flag would only
ever apply to a fresh JetStream store."""

from __future__ import annotations

import asyncio
import json
import time

import nats
from nats.js.errors import NotFoundError

from services.jobs.service import JobsService
from shared import subjects


async def consumer_ack_wait(nc) -> float:
    info = await nc.jetstream().consumer_info(subjects.JOBS_STREAM, subjects.JOBS_CONSUMER)
    return info.config.ack_wait


def test_a_service_started_with_another_ack_wait_changes_the_durable_consumer(nats_url):
    async def go() -> list[float]:
        nc = await nats.connect(nats_url)
        seen = []
        for ack_wait_s in (30.0, 4.5, 4.5):
            service = JobsService(nc, ack_wait_s=ack_wait_s)
            await service.start()
            seen.append(await consumer_ack_wait(nc))
            await service.stop()
        await nc.close()
        return seen

    assert asyncio.run(go()) == [30.0, 4.5, 4.5]


def test_a_stop_cut_short_hands_the_jobs_in_flight_back_at_once(nats_url):
    """`orca serve` cuts the drain short (a second SIGTERM) when its engines died with Ray: the jobs
    in flight go back to JetStream (not acked) at once instead of after --drain-timeout."""
    async def go() -> tuple[bool, float, int]:
        nc = await nats.connect(nats_url)

        async def never_answer(msg) -> None:
            return None

        await nc.subscribe(subjects.GENERATE, cb=never_answer)  # a tokenizer that takes requests, never answers
        service = JobsService(nc, ack_wait_s=30.0)
        await service.start()
        await nc.jetstream().publish(subjects.JOBS_SUBMIT, b'{"prompt": "x", "max_tokens": 4}',
                                     headers={"Nats-Msg-Id": "cut-short-1"})
        deadline = asyncio.get_running_loop().time() + 10
        while not service.in_flight:
            assert asyncio.get_running_loop().time() < deadline, "the job was never taken"
            await asyncio.sleep(0.05)
        cut_short = asyncio.Event()
        stopping = asyncio.create_task(service.stop(60.0, cut_short=cut_short))
        await asyncio.sleep(0.3)
        waited = not stopping.done()
        cut_short.set()
        began = asyncio.get_running_loop().time()
        await asyncio.wait_for(stopping, 5)
        took = asyncio.get_running_loop().time() - began
        info = await nc.jetstream().consumer_info(subjects.JOBS_STREAM, subjects.JOBS_CONSUMER)
        await nc.close()
        return waited, took, info.num_ack_pending + info.num_pending

    waited, took, unfinished = asyncio.run(go())
    assert waited, "without the cut, the stop waits for the job in flight"
    assert took < 10.0, took  # at once, not after the 60 s drain (`make test` may starve it a few seconds)
    assert unfinished >= 1, "the job is still JetStream's, to be handed out again"


def test_a_job_refused_for_a_passing_reason_is_handed_out_again_and_its_result_is_an_orca_generate_line(nats_url):
    """A stand-in tokenizer refuses the job's first generation with an error that passes (`retry`: the
    admission queue was full) and serves the second: the first stores no result (under the same
    Nats-Msg-Id the job could never run again), JetStream hands the job out again after the nak's delay,
    and the result carries what `orca generate` writes: logprobs, tool_calls, queue_s/ttft_s/latency_s."""
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": "{}"}, "type": "function"}
    lp = {"token_id": 5, "logprob": -0.25, "top_logprobs": [{"token_id": 5, "logprob": -0.25}]}

    async def go():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        requests: dict[str, float] = {}

        async def tokenizer(msg) -> None:
            request_id = json.loads(msg.data)["id"]
            requests[request_id] = time.monotonic()
            if request_id == "transient-1~1":
                events = [{"id": request_id, "token_ids": [], "text": "", "finish_reason": "error",
                           "error": "admission queue full", "retry": True}]
            else:
                events = [{"id": request_id, "token_ids": [5], "text": "a", "finish_reason": None, "logprobs": [lp]},
                          {"id": request_id, "token_ids": [], "text": "", "finish_reason": "stop", "tool_calls": [call],
                           "prompt_token_ids": [1, 2], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}]
            for seq, event in enumerate(events):
                await asyncio.sleep(0.05)
                await nc.publish(msg.reply, json.dumps({**event, "seq": seq}).encode())

        await nc.subscribe(subjects.GENERATE, cb=tokenizer)
        service = JobsService(nc, ack_wait_s=30.0)
        await service.start()
        body = {"messages": [{"role": "user", "content": "weather?"}], "logprobs": 1, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
        await js.publish(subjects.JOBS_SUBMIT, json.dumps(body).encode(), headers={"Nats-Msg-Id": "transient-1"})
        result, stored_before_rerun = None, False
        deadline = time.monotonic() + 20
        while result is None:  # README's loop: the result is there once the job has run
            assert time.monotonic() < deadline, f"no result; requests {requests}"
            try:
                result = json.loads((await js.get_last_msg(subjects.JOBS_RESULTS_STREAM,
                                                           subjects.jobs_result("transient-1"))).data)
                stored_before_rerun = "transient-1~2" not in requests
            except NotFoundError:
                await asyncio.sleep(0.1)
        max_deliver = getattr(service, "max_deliver", None)
        await service.stop()
        await nc.close()
        return result, stored_before_rerun, requests, max_deliver

    result, stored_before_rerun, requests, max_deliver = asyncio.run(go())
    assert not stored_before_rerun, f"the passing error was stored as the result: {result}"
    assert requests["transient-1~2"] - requests["transient-1~1"] >= 1.4, "handed out again after the nak's delay"
    assert max_deliver is None or max_deliver <= 0, "no max_deliver: a job is handed out again until it runs"
    assert list(result) == ["id", "prompt_token_ids", "token_ids", "text", "finish_reason", "tool_calls", "logprobs",
                            "metrics"]
    assert (result["id"], result["finish_reason"], result["token_ids"]) == ("transient-1", "stop", [5])
    assert result["logprobs"] == [lp] and result["tool_calls"] == [call]
    assert result["metrics"]["queue_s"] is None and 0 < result["metrics"]["ttft_s"] < result["metrics"]["latency_s"]
