"""The gateway's stream writer, in memory (no NATS, no Ray): the first event is written at once;
what arrives while the client is reading a write leaves in the next one, merged per choice (one
SSE chunk with several tokens, a logprob per token); the last write carries the rest, usage and
[DONE]; an error after some text sends the text, then the error."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from types import SimpleNamespace

from services.gateway.completions import Call, EventStream, _stream
from services.gateway.engine_client import Event, Generation, coalesce
from shared.api import GenerateRequest, Usage


class FakeClient:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_soon(self, ids: list[str]) -> None:
        self.aborted += ids

    def forget(self, generation: Generation) -> None:
        pass


def lp(t: int) -> dict:
    return {"token_id": t, "logprob": -t / 10, "top_logprobs": []}


def tok(t: int, rid: str = "c-0", logprobs: bool = False) -> Event:
    return Event(rid, [t], f"<{t}>", None, logprobs=[lp(t)] if logprobs else None)


def final(t: int, rid: str = "c-0", reason: str = "length", completion: int = 4) -> Event:
    return Event(rid, [t], f"<{t}>", reason, usage=Usage(2, completion))


def generation(n: int = 1) -> Generation:
    requests = [GenerateRequest(f"c-{i}", prompt_token_ids=[1, 2]) for i in range(n)]
    return Generation(FakeClient(), "cmpl-x", requests)


def call_of(gen: Generation, chat: bool = False, logprobs: bool = False) -> Call:
    state = SimpleNamespace(settings=SimpleNamespace(model_name="m"), token_text=lambda t: f"<{t}>",
                            token_bytes=lambda t: f"<{t}>".encode(), tokens=Counter())
    return Call(state, "cmpl-x", chat, gen, [2], None, logprobs, include_usage=True)


def events_of(write: bytes) -> list:
    blocks = write.decode().split("\n\n")[:-1]
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks]


async def read_slowly(gen: Generation, call: Call, deliveries: list[list[tuple[int, Event]]]) -> list[bytes]:
    """Stream the call; before each next read, `deliveries[i]` arrive (the client is slow to read)."""
    watcher = asyncio.get_running_loop().create_future()
    first = await gen.next()
    writes = []
    async for write in _stream(call, first, watcher):
        writes.append(write)
        for index, event in deliveries.pop(0) if deliveries else ():
            gen.deliver(index, event)
    return writes


def test_coalesce_merges_each_choice_in_arrival_order():
    merged = coalesce([(0, tok(1, logprobs=True)), (1, tok(7, "c-1")), (0, tok(2, logprobs=True)),
                       (0, final(3))])
    assert [index for index, _ in merged] == [0, 1]
    first = merged[0][1]
    assert (first.token_ids, first.text, first.finish_reason) == ([1, 2, 3], "<1><2><3>", "length")
    assert first.usage == Usage(2, 4)
    assert [e["token_id"] for e in first.logprobs] == [1, 2]
    assert merged[1][1].token_ids == [7]


def test_an_error_after_text_stays_an_event_of_its_own():
    merged = coalesce([(0, tok(1)), (0, Event("c-0", [], "", "error", error="engine died"))])
    assert [(e.token_ids, e.text, e.finish_reason) for _, e in merged] == [([1], "<1>", None), ([], "", "error")]


def test_take_waits_for_nothing_but_the_next_event():
    async def go():
        gen = generation()
        waiting = asyncio.ensure_future(gen.take())
        await asyncio.sleep(0)
        assert not waiting.done()
        asyncio.get_running_loop().call_soon(gen.deliver, 0, tok(5))
        return await asyncio.wait_for(waiting, timeout=30)
    assert [(i, e.token_ids) for i, e in asyncio.run(go())] == [(0, [5])]


def test_a_slow_reader_gets_several_tokens_per_chunk_and_the_ending_in_one_write():
    async def go():
        gen = generation()
        call = call_of(gen, logprobs=True)
        gen.deliver(0, tok(1, logprobs=True))
        piled_up = [(0, tok(2, logprobs=True)), (0, tok(3, logprobs=True)), (0, tok(4, logprobs=True))]
        writes = await read_slowly(gen, call, [piled_up, [(0, final(5, completion=5))]])
        return writes, call
    writes, call = asyncio.run(go())
    assert len(writes) == 3
    first, merged, last = (events_of(w) for w in writes)
    assert [c["choices"][0]["text"] for c in first] == ["<1>"], "the first token alone, at once"
    assert len(merged) == 1 and merged[0]["choices"][0]["text"] == "<2><3><4>"
    logprobs = merged[0]["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<2>", "<3>", "<4>"] and logprobs["token_logprobs"] == [-0.2, -0.3, -0.4]
    assert logprobs["text_offset"] == [3, 6, 9]
    assert last[0]["choices"][0]["finish_reason"] == "length" and last[0]["choices"][0]["text"] == "<5>"
    assert last[1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert last[2] == "[DONE]"
    assert call.state.tokens["completion"] == 5, "metrics count every token"


def test_chat_chunks_of_several_choices_share_a_write():
    async def go():
        gen = generation(2)
        call = call_of(gen, chat=True)
        call.prompt_lens = [2, 2]
        gen.deliver(0, tok(1))
        both = [(1, tok(7, "c-1")), (0, final(2, completion=2)), (1, final(8, "c-1", "stop", 2))]
        return await read_slowly(gen, call, [both])
    writes = asyncio.run(go())
    assert len(writes) == 2
    chunks = [c for c in events_of(writes[1]) if c != "[DONE]"]
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
              for c in chunks if c["choices"]]
    assert deltas == [(1, {"role": "assistant", "content": ""}, None), (1, {"content": "<7><8>"}, None),
                      (1, {}, "stop"), (0, {"content": "<2>"}, None), (0, {}, "length")]


def test_an_error_mid_stream_sends_the_text_then_the_error():
    async def go():
        gen = generation()
        call = call_of(gen)
        gen.deliver(0, tok(1))
        failing = [(0, tok(2)), (0, Event("c-0", [], "", "error", error="engine 0 failed: WorkerDied"))]
        return await read_slowly(gen, call, [failing])
    writes = asyncio.run(go())
    last = events_of(writes[-1])
    assert last[0]["choices"][0]["text"] == "<2>"
    assert last[1]["error"]["code"] == 503 and "WorkerDied" in last[1]["error"]["message"]
    assert last[2] == "[DONE]" and len(last) == 3


def test_tokens_that_make_no_text_yet_are_still_a_chunk_so_the_client_sees_the_first_token():
    """A byte of a character (or text a stop string may claim) decodes to nothing yet: vLLM still sends
    a chunk for the token, so clients time the first token when it comes; before, the first chunk
    waited for text (83 ms against 24 on a prompt whose first tokens were bytes)."""
    byte = Event("c-0", [300], "", None)
    completion = call_of(generation()).chunks(0, byte)
    assert [c["choices"][0]["text"] for c in completion] == [""]
    chat = call_of(generation(), chat=True)
    assert [c["choices"][0]["delta"] for c in chat.chunks(0, byte)] == [{"role": "assistant", "content": ""}]
    assert [c["choices"][0]["delta"] for c in chat.chunks(0, Event("c-0", [301], "", None))] == [{"content": ""}]
    assert call_of(generation()).chunks(0, Event("c-0", [], "", None)) == [], "no token, no text: nothing to send"


def test_a_stream_under_asgi_2_3_leaves_receive_to_the_disconnect_watcher():
    """uvicorn says ASGI 2.3, under which Starlette's StreamingResponse reads `receive` itself, in an anyio task
    group beside the stream. The call's `_abort_on_disconnect` is the one reader: EventStream streams alone."""
    async def go():
        gen, sent, reads = generation(), [], []
        gen.deliver(0, tok(1))
        gen.deliver(0, final(2))
        call = call_of(gen)
        stream = _stream(call, await gen.next(), asyncio.get_running_loop().create_future())

        async def receive() -> dict:
            reads.append(1)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}
        await EventStream(stream, media_type="text/event-stream")(scope, receive, send)
        return sent, reads
    sent, reads = asyncio.run(go())
    assert reads == [], "only the disconnect watcher reads receive"
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert [e if e == "[DONE]" else e["choices"][0]["text"] for e in events_of(body) if e == "[DONE]" or e["choices"]] \
        == ["<1>", "<2>", "[DONE]"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
