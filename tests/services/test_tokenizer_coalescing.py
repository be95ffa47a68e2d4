"""The tokenizer's event writer, with an in-memory NATS connection and tokenizer: a lone token
leaves at once; what piles up while the writer is busy leaves in one event (tokens, text, a logprob
per token, the final reason and usage); a stop string still ends the stream where it matched."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from services.tokenizer.service import TokenizerService
from shared import subjects
from shared.codec import Codec
from shared.messages import IterationOutputs
from shared.outputs import FinishReason, RequestOutput, TokenLogprob
from tests.fake_nats import RecordingNats

REPLY = "client.inbox.r1"


class FakeTokenizer:
    """Token t decodes to `<t>`."""

    eos_token_ids = (2,)

    def decode(self, token_ids) -> str:
        return "".join(f"<{t}>" for t in token_ids)


class FakeNats(RecordingNats):
    """Records publishes; while `gate` is clear, a publish to a client's reply subject waits for it
    (a writer that is busy writing)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        if subject == REPLY:
            await self.gate.wait()
        await super().publish(subject, payload, reply, headers)

    def events(self) -> list[dict]:
        return [json.loads(data) for data in self.on(REPLY)]


async def started(body: dict | None = None) -> tuple[TokenizerService, FakeNats]:
    nc = FakeNats()
    service = TokenizerService(nc, FakeTokenizer(), vocab_size=100)
    await service.start()
    request = {"id": "r1", "prompt_token_ids": [1, 2, 3], "max_tokens": 8, **(body or {})}
    await service.on_generate(SimpleNamespace(data=json.dumps(request).encode(), reply=REPLY, headers=None))
    return service, nc


def iteration(*outputs: RequestOutput) -> SimpleNamespace:
    return SimpleNamespace(data=Codec.encode(IterationOutputs(list(outputs))))


def token(t: int, reason: FinishReason | None = None, logprob: bool = False) -> RequestOutput:
    logprobs = (TokenLogprob(t, -t / 10, ((t, -t / 10), (99, -5.0))),) if logprob else None
    return RequestOutput("r1", (t,), logprobs, reason)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def busy_then(service: TokenizerService, nc: FakeNats, *later: RequestOutput) -> None:
    """The first token goes out and its write blocks; `later` arrive meanwhile, one message each."""
    nc.gate.clear()
    await service.on_outputs(iteration(token(10, logprob=True)))
    await settle()
    for output in later:
        await service.on_outputs(iteration(output))
    await settle()
    nc.gate.set()
    await settle()


def test_a_lone_first_token_is_written_at_once():
    async def go():
        service, nc = await started()
        await service.on_outputs(iteration(token(10)))
        await settle()  # no clock advances: a writer that waited on a timer would not have written yet
        events = nc.events()
        await service.stop_writer()
        return events
    events = asyncio.run(go())
    assert events == [{"id": "r1", "token_ids": [10], "text": "<10>", "finish_reason": None}]


def test_a_busy_writer_sends_what_piled_up_in_one_event():
    async def go():
        service, nc = await started()
        await busy_then(service, nc, token(11), token(12), token(13))
        await service.stop_writer()
        return nc.events()
    events = asyncio.run(go())
    assert [e["token_ids"] for e in events] == [[10], [11, 12, 13]]
    assert [e["text"] for e in events] == ["<10>", "<11><12><13>"]


def test_the_final_event_carries_the_remaining_tokens_and_usage():
    async def go():
        service, nc = await started()
        await busy_then(service, nc, token(11), token(12, FinishReason.LENGTH))
        await service.stop_writer()
        return nc.events(), service
    events, service = asyncio.run(go())
    final = events[-1]
    assert len(events) == 2 and final["token_ids"] == [11, 12] and final["text"] == "<11><12>"
    assert final["finish_reason"] == "length"
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}
    assert final["prompt_token_ids"] == [1, 2, 3]
    assert service.active == {}
    assert service.telemetry.generation_tokens == 3, "metrics count every token"
    assert sum(service.telemetry.itl.counts) == 2, "one inter-token gap per output, as without coalescing"


def test_logprobs_stay_one_per_token():
    async def go():
        service, nc = await started({"logprobs": 1})
        await busy_then(service, nc, token(11, logprob=True), token(12, FinishReason.STOP, logprob=True))
        await service.stop_writer()
        return nc.events()
    events = asyncio.run(go())
    merged = events[1]
    assert [lp["token_id"] for lp in merged["logprobs"]] == merged["token_ids"] == [11, 12]
    assert [lp["logprob"] for lp in merged["logprobs"]] == [-1.1, -1.2]
    assert merged["logprobs"][0]["top_logprobs"] == [{"token_id": 11, "logprob": -1.1},
                                                     {"token_id": 99, "logprob": -5.0}]


def test_prompt_logprobs_go_with_the_first_token_only():
    """The engine sends them with a request's first token: the tokenizer's first event carries them (merged
    with later tokens or not), no other event does."""
    prompt = (TokenLogprob(2, -0.5, ((2, -0.5),)), TokenLogprob(3, -0.25, ((9, -0.1),)))

    async def go():
        service, nc = await started({"prompt_logprobs": 1})
        await service.on_outputs(iteration(RequestOutput("r1", (10,), prompt_logprobs=prompt)))
        await settle()
        await service.on_outputs(iteration(token(11), token(12, FinishReason.LENGTH)))
        await settle()
        await service.stop_writer()
        return nc.events()
    events = asyncio.run(go())
    assert events[0]["prompt_logprobs"] == [
        {"token_id": 2, "logprob": -0.5, "top_logprobs": [{"token_id": 2, "logprob": -0.5}]},
        {"token_id": 3, "logprob": -0.25, "top_logprobs": [{"token_id": 9, "logprob": -0.1}]}]
    assert all("prompt_logprobs" not in e for e in events[1:]) and events[-1]["finish_reason"] == "length"


def test_a_requests_cache_salt_and_prompt_logprobs_travel_to_admission_with_it():
    from shared import subjects
    from shared.codec import Codec
    from shared.messages import TokenizedRequest

    async def go():
        service, nc = await started({"cache_salt": "tenant-a", "prompt_logprobs": 2})
        await service.stop_writer()
        return [Codec(TokenizedRequest).decode(d) for d in nc.on(subjects.ADMISSION_SUBMIT)]
    [submitted] = asyncio.run(go())
    assert submitted.cache_salt == "tenant-a" and submitted.params.prompt_logprobs == 2


def test_a_stop_string_ends_the_merged_event_where_it_matched():
    async def go():
        service, nc = await started({"stop": ["<12>"]})
        await busy_then(service, nc, token(11), token(12), token(13))
        await service.on_outputs(iteration(token(14)))  # the engine had not heard of the stop yet
        await settle()
        await service.stop_writer()
        return nc
    nc = asyncio.run(go())
    events = nc.events()
    assert [e["token_ids"] for e in events] == [[10], [11, 12]], "nothing after the output that matched"
    assert "".join(e["text"] for e in events) == "<10><11>"
    assert events[-1]["finish_reason"] == "stop" and events[-1]["usage"]["completion_tokens"] == 3
    assert len(nc.on(subjects.CANCEL)) == 1


def test_outputs_of_several_requests_in_one_message_each_get_their_event():
    async def go():
        service, nc = await started()
        await service.on_generate(SimpleNamespace(data=b'{"id": "r2", "prompt_token_ids": [4]}', reply="other",
                                                  headers=None))
        await service.on_outputs(iteration(token(10), RequestOutput("r2", (20,), None, FinishReason.LENGTH)))
        await settle()
        await service.stop_writer()
        return nc
    nc = asyncio.run(go())
    assert [e["token_ids"] for e in nc.events()] == [[10]]
    other = [json.loads(d) for d in nc.on("other")]
    assert [(e["token_ids"], e["finish_reason"]) for e in other] == [([20], "length")]


def test_a_stop_string_inside_an_output_of_several_tokens_ends_at_the_token_that_completed_it():
    """The static policy hands a lane's tokens over in one output when its batch ends (with LENGTH): the
    tokens after the stop string were generated past it, and are not the request's."""
    async def go():
        service, nc = await started({"stop": ["<12>"]})
        await service.on_outputs(iteration(RequestOutput("r1", (10, 11, 12, 13, 14), None, FinishReason.LENGTH)))
        await settle()
        await service.stop_writer()
        return nc
    nc = asyncio.run(go())
    [event] = nc.events()
    assert event["token_ids"] == [10, 11, 12] and event["text"] == "<10><11>"
    assert event["finish_reason"] == "stop" and event["usage"]["completion_tokens"] == 3
    assert nc.on(subjects.CANCEL) == [], "the engine had ended it already"


def test_a_stop_string_completed_by_the_last_token_max_tokens_allows_is_a_stop():
    async def go():
        service, nc = await started({"stop": ["<11>"], "max_tokens": 2})
        await service.on_outputs(iteration(token(10)))
        await service.on_outputs(iteration(token(11, FinishReason.LENGTH)))
        await settle()
        await service.stop_writer()
        return nc
    nc = asyncio.run(go())
    events = nc.events()
    assert "".join(e["text"] for e in events) == "<10>"
    assert events[-1]["finish_reason"] == "stop", "the text was cut by the stop string, as OpenAI and vLLM say"


def test_a_long_prompt_is_tokenized_off_the_event_loop():
    """Every stream this instance serves waits while its loop tokenizes (seconds, for megabytes of text)."""
    import threading

    class Encoding(FakeTokenizer):
        def __init__(self) -> None:
            self.threads: list[bool] = []

        def encode(self, text: str) -> list[int]:
            self.threads.append(threading.current_thread() is threading.main_thread())
            return [1, 2]

    async def go():
        tokenizer = Encoding()
        service = TokenizerService(FakeNats(), tokenizer, vocab_size=100)
        await service.start()
        for rid, prompt in (("short", "hello"), ("long", "x" * 100_000)):
            body = json.dumps({"id": rid, "prompt": prompt, "max_tokens": 2}).encode()
            await service.on_generate(SimpleNamespace(data=body, reply=f"inbox.{rid}", headers=None))
        await service.stop_writer()
        return tokenizer.threads, sorted(service.active)

    on_main_thread, active = asyncio.run(go())
    assert on_main_thread == [True, False] and active == ["long", "short"]


def test_a_stop_token_that_ends_the_request_is_counted_but_not_written_as_text():
    async def go():
        service, nc = await started({"stop_token_ids": [12]})
        await service.on_outputs(iteration(token(12)))  # not the last: text like any other
        await settle()
        await service.on_outputs(iteration(token(11), token(12, FinishReason.STOP)))
        await settle()
        await service.stop_writer()
        return nc.events()
    events = asyncio.run(go())
    assert "".join(e["text"] for e in events) == "<12><11>"
    assert [t for e in events for t in e["token_ids"]] == [12, 11, 12]
    assert events[-1]["finish_reason"] == "stop" and events[-1]["usage"]["completion_tokens"] == 3
