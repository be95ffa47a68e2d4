"""The transports, against stand-ins: an httpx mock of an OpenAI streaming endpoint, and a fake
generate responder on a real nats-server. Both go through the streaming load generator."""

from __future__ import annotations

import asyncio
import json

import httpx

from loadtest.datasets import random_requests
from loadtest.loadgen import drive_streaming
from loadtest.targets import HttpTarget, NatsTarget

REQUESTS = random_requests(3, (4, 6), (2, 3), seed=0)


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


def openai_stream(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert isinstance(body["prompt"], list) and body["model"] == "demo"
    n = body["max_tokens"]
    chunks = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(n - 1)]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": None}]})  # empty text: not a token chunk
    chunks.append({"choices": [{"index": 0, "text": "end", "finish_reason": "length"}], "usage": None})
    chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
    return httpx.Response(200, content=sse(*chunks, "[DONE]"), headers={"content-type": "text/event-stream"})


def test_http_target_reads_openai_streaming_completions():
    async def main():
        async with HttpTarget("http://gateway", model="demo", transport=httpx.MockTransport(openai_stream)) as t:
            return await drive_streaming(t, REQUESTS, [0.0, 0.0, 0.01], progress=False)

    result = asyncio.run(main())
    for record, request in zip(result.records, REQUESTS):
        assert record.success, record.error
        assert record.output_tokens == request.max_tokens
        assert record.prompt_len == len(request.prompt_token_ids)
        assert len(record.chunk_times) == request.max_tokens  # one chunk per non-empty text
    assert result.duration_s > 0


def test_a_stream_whose_text_all_comes_last_still_has_a_first_token_time():
    """Held-back text (an incomplete UTF-8 sequence, say) can leave every chunk but the last empty."""

    def late_text(request: httpx.Request) -> httpx.Response:
        n = json.loads(request.content)["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None},
                  {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}}]
        return httpx.Response(200, content=sse(*chunks, "[DONE]"), headers={"content-type": "text/event-stream"})

    async def main():
        async with HttpTarget("http://gateway", transport=httpx.MockTransport(late_text)) as t:
            return await drive_streaming(t, REQUESTS[:1], [0.0], progress=False)

    result = asyncio.run(main())
    [record] = result.records
    assert record.success and len(record.chunk_times) == 1 and record.ttft_s >= 0


def test_http_errors_are_failed_requests():
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "queue full"}})

    async def main():
        async with HttpTarget("http://gateway", transport=httpx.MockTransport(refuse)) as t:
            return await drive_streaming(t, REQUESTS[:1], [0.0], progress=False)

    [record] = asyncio.run(main()).records
    assert not record.success and "429" in record.error


def test_nats_target_streams_generate_events(nats_url):
    import nats

    async def main():
        responder = await nats.connect(nats_url)

        async def on_generate(msg):
            body = json.loads(msg.data)
            for i in range(body["max_tokens"]):
                final = i == body["max_tokens"] - 1
                event = {"id": body["id"], "token_ids": [7], "text": "x", "finish_reason": "length" if final else None}
                if final:
                    event["usage"] = {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": i + 1}
                await responder.publish(msg.reply, json.dumps(event).encode())

        await responder.subscribe("orca.v1.generate", cb=on_generate)
        await responder.flush()
        try:
            async with NatsTarget(nats_url) as target:
                return await drive_streaming(target, REQUESTS, [0.0, 0.0, 0.0], max_concurrency=2, progress=False)
        finally:
            await responder.close()

    result = asyncio.run(main())
    assert [r.output_tokens for r in result.records] == [r.max_tokens for r in REQUESTS]
    assert all(r.success and r.prompt_len == len(q.prompt_token_ids) for r, q in zip(result.records, REQUESTS))


def test_nats_request_without_answer_times_out_as_a_failure(nats_url):
    async def main():
        async with NatsTarget(nats_url) as target:
            return await drive_streaming(target, REQUESTS[:1], [0.0], timeout_s=0.2, progress=False)

    [record] = asyncio.run(main()).records
    assert not record.success and "no final event" in record.error
