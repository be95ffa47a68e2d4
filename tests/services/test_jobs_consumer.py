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
