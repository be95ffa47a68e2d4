"""Back-pressure through HTTP: a stack with one sequence per engine and a queue of 2 (and an API key,
given as `orca serve --api-key`). A flood gets some 429s with Retry-After and every accepted request
completes; while the queue is full, a request is refused at once, before anything is published."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import nats
import pytest

from shared import subjects
from tests.gateway.helpers import GatewayServe
from tests.services.stack import engine_statuses

pytestmark = pytest.mark.slow

KEY = "bp-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stack(demo_model):
    serve = GatewayServe(["--model", demo_model, "--max-num-seqs", "1", "--max-queue-len", "2",
                          "--kv-cache-tokens", "4096", "--worker-threads", "1", "--api-key", KEY])
    yield serve
    assert serve.stop() == 0
    assert not any(KEY in line for line in serve.log), "the API key must never be logged"


def test_the_key_is_required(stack):
    assert httpx.get(stack.http_url + "/health").status_code == 200
    assert httpx.post(stack.http_url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(stack.http_url + "/v1/models", headers=AUTH).status_code == 200


def test_a_flood_gets_429s_and_every_accepted_request_completes(stack):
    async def go():
        async with httpx.AsyncClient(base_url=stack.http_url, headers=AUTH, timeout=120) as client:
            body = {"prompt": "x = 1", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(12)])
    responses = asyncio.run(go())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8


async def _hold(client: httpx.AsyncClient, body: dict, release: asyncio.Event) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_lines():
            if release.is_set():
                return


def test_a_full_queue_is_refused_at_once_without_publishing(stack):
    async def go():
        nc = await nats.connect(stack.nats_url)
        published: list[dict] = []

        async def on_generate(msg):
            published.append(json.loads(msg.data))
        await nc.subscribe(subjects.GENERATE, cb=on_generate)
        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=stack.http_url, headers=AUTH, timeout=120) as client:
            long = {"prompt": "x = 1", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
            holders = [asyncio.create_task(_hold(client, long, release)) for _ in range(3)]  # 1 runs, 2 wait
            for _ in range(100):
                if "orca:admission_queue_len 2" in (await client.get("/metrics")).text:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the queue never filled")
            await nc.flush()
            seen = len(published)
            started = time.monotonic()
            refused = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            elapsed = time.monotonic() - started
            await asyncio.sleep(0.3)
            await nc.flush()
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
            assert elapsed < 1.0
            assert len(published) == seen, "nothing was published for the refused request"
            release.set()
            await asyncio.gather(*holders)
        await nc.close()
    asyncio.run(go())
    time.sleep(1.0)
    for status in asyncio.run(engine_statuses(stack.nats_url)).values():
        assert status.kv_used_blocks == 0 and status.num_running == 0
