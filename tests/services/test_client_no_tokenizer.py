"""shared.client.generate (the README's client rule) against a real nats-server where no tokenizer listens:
it retries, then ends with an error event that says the request may be sent again later."""

from __future__ import annotations

import asyncio

import nats

from shared import client


def test_no_tokenizer_for_long_is_an_error_worth_a_retry(nats_url, monkeypatch):
    monkeypatch.setattr(client, "NO_TOKENIZER_RETRY_S", 1.0)

    async def go() -> list[dict]:
        nc = await nats.connect(nats_url)
        try:
            return await client.generate(nc, {"id": "lonely", "prompt": "hi", "max_tokens": 2}, timeout_s=20)
        finally:
            await nc.close()

    events = asyncio.run(go())
    assert events[-1]["finish_reason"] == "error" and "no tokenizer" in events[-1]["error"]
    assert events[-1]["retry"] is True
