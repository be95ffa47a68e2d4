"""The jobs consumer's ack wait (`--jobs-ack-wait`) on a real nats-server: the durable consumer outlives
the service, so a service started with another value must change the consumer's, or the flag would only
ever apply to a fresh JetStream store."""

from __future__ import annotations

import asyncio

import nats

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
