"""Structured outputs and tools over NATS (the tokenizer service, in-memory NATS and tokenizer) and in
`orca generate` (batch_job, a scripted engine): bad constraints are error events / error records and
never reach admission or an engine; a valid one travels in the submitted SamplingParams; with tools
the final event / record carries the calls read from the whole output."""

from __future__ import annotations

import asyncio
import io
import json
from types import SimpleNamespace

import pytest

from engine.batch_job import run_batch
from engine.llm_engine import Completion, Delta
from services.tokenizer.service import TokenizerService
from shared import subjects
from shared.codec import Codec
from shared.messages import IterationOutputs, TokenizedRequest
from shared.outputs import FinishReason, RequestOutput
from tests.services.test_tokenizer_coalescing import REPLY, FakeNats, settle

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOKENIZED = Codec(TokenizedRequest)
MESSAGES = [{"role": "user", "content": "weather?"}]
REQUIRED_OUTPUT = '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'


class CharTokenizer:
    """Token t is chr(t); a chat renders as its contents, with the tools' names in front."""

    eos_token_id = 0
    eos_token_ids = (0,)

    def __init__(self) -> None:
        self.tools: list = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids) -> str:
        return "".join(chr(t) for t in token_ids)

    def apply_chat_template(self, messages, tools=None, chat_template=None, turn=None, template_kwargs=None) -> list[int]:
        self.tools.append(tools)
        return self.encode("".join(m.get("content") or "" for m in messages))


BAD = [
    ({"structured_outputs": {"regex": "(a"}}, "invalid structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "invalid structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "invalid structured_outputs.grammar"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "both constrain"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "'fly'"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "both constrain"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
]


async def generate(body: dict, tokenizer: CharTokenizer | None = None) -> tuple[TokenizerService, FakeNats]:
    nc = FakeNats()
    service = TokenizerService(nc, tokenizer or CharTokenizer(), vocab_size=0x3000)
    await service.start()
    request = {"id": "r1", "messages": MESSAGES, "max_tokens": 64, **body}
    await service.on_generate(SimpleNamespace(data=json.dumps(request).encode(), reply=REPLY, headers=None))
    return service, nc


def submitted(nc: FakeNats) -> list[TokenizedRequest]:
    return [TOKENIZED.decode(data) for data in nc.on(subjects.ADMISSION_SUBMIT)]


@pytest.mark.parametrize("body,words", BAD)
def test_a_bad_constraint_is_an_error_event_and_is_never_submitted(body, words):
    async def go():
        service, nc = await generate(body)
        await service.stop_writer()
        return nc
    nc = asyncio.run(go())
    [event] = nc.events()
    assert event["finish_reason"] == "error" and words in event["error"], event
    assert submitted(nc) == []


def run_tokens(body: dict, output: str, reason: FinishReason = FinishReason.STOP):
    """A request through the tokenizer service, the engine answering `output` (a token per character)."""
    async def go():
        tokenizer = CharTokenizer()
        service, nc = await generate(body, tokenizer)
        tokens = [ord(c) for c in output]
        outputs = [RequestOutput("r1", (t,), None, reason if i == len(tokens) - 1 else None)
                   for i, t in enumerate(tokens)]
        await service.on_outputs(SimpleNamespace(data=Codec.encode(IterationOutputs(outputs))))
        await settle()
        await service.stop_writer()
        return nc, tokenizer
    return asyncio.run(go())


def test_the_constraint_travels_to_admission_in_the_sampling_params():
    nc, tokenizer = run_tokens({"tools": [WEATHER], "tool_choice": "required"}, REQUIRED_OUTPUT)
    [request] = submitted(nc)
    schema = json.loads(request.params.structured_outputs.json)
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    assert tokenizer.tools == [[WEATHER]], "the template got the tools"


def test_the_final_event_carries_the_tool_calls():
    nc, _ = run_tokens({"tools": [WEATHER], "tool_choice": "required"}, REQUIRED_OUTPUT)
    events = nc.events()
    assert "".join(e["text"] for e in events) == REQUIRED_OUTPUT, "the text is the output as written"
    [call] = events[-1]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}, "as the model wrote them"
    assert all("tool_calls" not in e for e in events[:-1])

    named = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    nc, _ = run_tokens(named, '{"city":"Rome"}')
    assert nc.events()[-1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}

    nc, _ = run_tokens({"tools": [WEATHER]}, 'ok <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert nc.events()[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    nc, _ = run_tokens({"tools": [WEATHER]}, "just text")
    assert "tool_calls" not in nc.events()[-1]
    nc, _ = run_tokens({}, REQUIRED_OUTPUT)
    assert "tool_calls" not in nc.events()[-1], "no tools, no parsing"
    nc, _ = run_tokens({"tools": [WEATHER], "tool_choice": "required"}, REQUIRED_OUTPUT[:20], FinishReason.LENGTH)
    assert "tool_calls" not in nc.events()[-1], "cut short: only text"


def test_tools_without_messages_are_refused():
    async def go():
        nc = FakeNats()
        service = TokenizerService(nc, CharTokenizer(), vocab_size=0x3000)
        await service.start()
        body = {"id": "r1", "prompt": "x", "tools": [WEATHER]}
        await service.on_generate(SimpleNamespace(data=json.dumps(body).encode(), reply=REPLY, headers=None))
        await service.stop_writer()
        return nc
    [event] = asyncio.run(go()).events()
    assert event["finish_reason"] == "error" and "need messages" in event["error"]


# ---- orca generate --------------------------------------------------------------------------

class ScriptedEngine:
    """LLMEngine's surface that run_batch uses; every request's output is `outputs[id]`, in one step."""

    def __init__(self, outputs: dict[str, str]) -> None:
        self.outputs = outputs
        self.added: dict[str, object] = {}
        self.tokenizer = CharTokenizer()

    def prompt_ids(self, request) -> list[int]:
        return [1, 2, 3]

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None) -> None:
        self.added[request_id] = params

    @property
    def has_unfinished(self) -> bool:
        return bool(self.added)

    def step(self) -> list[Delta]:
        deltas = []
        for request_id in list(self.added):
            text = self.outputs[request_id]
            completion = Completion(request_id, [1, 2, 3], [ord(c) for c in text], text,
                                    finish_reason=FinishReason.STOP)
            deltas.append(Delta(completion, tuple(completion.token_ids), text))
            del self.added[request_id]
        return deltas


def test_orca_generate_records_tool_calls_and_names_bad_constraints():
    lines = [
        {"id": "req", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"},
        {"id": "bad", "messages": MESSAGES, "structured_outputs": {"regex": "(a"}},
        {"id": "plain", "prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}},
        {"id": "unknown", "messages": MESSAGES, "tools": [WEATHER],
         "tool_choice": {"type": "function", "function": {"name": "fly"}}},
    ]
    engine = ScriptedEngine({"req": REQUIRED_OUTPUT, "plain": "yes"})
    out = io.StringIO()
    counts = run_batch(engine, [json.dumps(line) for line in lines], out, progress=False)
    records = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert counts == {"requests": 4, "errors": 2}
    assert records["req"]["text"] == REQUIRED_OUTPUT
    assert records["req"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    assert "line 2" in records["bad"]["error"] and "invalid structured_outputs.regex" in records["bad"]["error"]
    assert "line 4" in records["unknown"]["error"] and "'fly'" in records["unknown"]["error"]
    assert records["plain"]["text"] == "yes" and "tool_calls" not in records["plain"]


def test_parallel_tool_calls_false_allows_one_call():
    body = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    two_calls = REQUIRED_OUTPUT[:-1] + "," + REQUIRED_OUTPUT[1:]
    nc, _ = run_tokens(body, two_calls)
    [request] = submitted(nc)
    assert json.loads(request.params.structured_outputs.json)["maxItems"] == 1
    assert len(nc.events()[-1]["tool_calls"]) == 1
