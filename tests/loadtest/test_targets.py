"""The transports, against stand-ins: a local aiohttp server speaking OpenAI streaming completions, and
a fake generate responder on a real nats-server. Both go through the streaming load generator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket

import pytest
from aiohttp import web

from loadtest.datasets import random_requests
from loadtest.loadgen import drive_streaming
from loadtest.targets import HttpTarget, NatsTarget, warm_up_streaming

REQUESTS = random_requests(3, (4, 6), (2, 3), seed=0)


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


def event_stream(*events: dict | str) -> web.Response:
    return web.Response(body=sse(*events, "[DONE]"), content_type="text/event-stream")


@contextlib.asynccontextmanager
async def completions_server(handler):
    """`handler` (request body -> response) behind POST /v1/completions on a free local port; yields its URL."""
    async def completions(request: web.Request) -> web.Response:
        return handler(await request.json())

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def openai_stream(body: dict) -> web.Response:
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert isinstance(body["prompt"], list) and body["model"] == "demo"
    n = body["max_tokens"]
    chunks = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(n - 1)]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": None}]})  # empty text: not a token chunk
    chunks.append({"choices": [{"index": 0, "text": "end", "finish_reason": "length"}], "usage": None})
    chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
    return event_stream(*chunks)


def test_http_target_reads_openai_streaming_completions():
    async def main():
        async with completions_server(openai_stream) as url, HttpTarget(url, model="demo") as t:
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

    def late_text(body: dict) -> web.Response:
        n = body["max_tokens"]
        return event_stream({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None},
                            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})

    async def main():
        async with completions_server(late_text) as url, HttpTarget(url) as t:
            return await drive_streaming(t, REQUESTS[:1], [0.0], progress=False)

    result = asyncio.run(main())
    [record] = result.records
    assert record.success and len(record.chunk_times) == 1 and record.ttft_s >= 0


def test_http_errors_are_failed_requests():
    def refuse(body: dict) -> web.Response:
        return web.json_response({"error": {"message": "queue full"}}, status=429)

    async def main():
        async with completions_server(refuse) as url, HttpTarget(url) as t:
            return await drive_streaming(t, REQUESTS[:1], [0.0], progress=False)

    [record] = asyncio.run(main()).records
    assert not record.success and "429" in record.error and "queue full" in record.error


def test_a_server_that_is_not_there_is_a_failed_request_not_a_crash():
    async def main():
        async with completions_server(openai_stream) as url:
            pass  # the port is free again
        async with HttpTarget(url) as t:
            return await drive_streaming(t, REQUESTS[:1], [0.0], progress=False)

    [record] = asyncio.run(main()).records
    assert not record.success and record.error


def test_a_warm_up_that_cannot_reach_its_server_is_one_clear_error():
    """`orca bench` warms the server up first: there a server that is not there is a usage error, not a traceback."""
    async def main():
        async with completions_server(openai_stream) as url:
            pass  # the port is free again
        async with HttpTarget(url) as t:
            await warm_up_streaming(t, REQUESTS[0])

    with pytest.raises(ValueError, match=r"the warm-up request failed \(ClientConnectorError: .*is the server up\?"):
        asyncio.run(main())


def test_a_nats_server_that_is_not_there_is_one_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nobody listens there

    async def main():
        async with NatsTarget(f"nats://bench:secret@127.0.0.1:{port}"):
            pass

    redacted = re.escape(f"nats://bench:***@127.0.0.1:{port}")
    with pytest.raises(ValueError, match=f"cannot connect to NATS at {redacted}") as raised:
        asyncio.run(main())
    assert "secret" not in str(raised.value)
    assert "Traceback" not in capsys.readouterr().err


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
