"""Structured outputs and tool calling at the gateway, with no stack (tests/gateway/fakes.py): the
request schema of the new fields, the 400s that keep bad constraints from the engine, the constraint
each request publishes, the tools and tool history the chat template gets, and tool calls in whole
and streamed responses, built from scripted generate events."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.gateway.constraints import ToolUse
from services.gateway.openai_types import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from services.gateway.tool_stream import ToolStream
from shared.structured import StructuredOutputs
from shared.tools import FunctionDefinition, FunctionName, NamedToolChoice, Tool
from tests.gateway.fakes import fake_gateway
from tests.gateway.helpers import sse_events

CHAT = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 20, **fields}


def answer(*texts: str):
    return lambda request: list(texts)


# ---- the request schema ------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True,
                                                                "description": "d"}}},
    {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"structured_outputs": {"regex": "[a-z]+"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"grammar": 'root ::= "a"'}}, {"structured_outputs": {"json_object": True}},
    {"guided_json": SCHEMA}, {"guided_regex": "a+"}, {"guided_choice": ["x"]}, {"guided_grammar": "start: \"a\""},
    {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": TOOLS, "tool_choice": NAMED}, {"tools": TOOLS, "tool_choice": "none"},
    {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": TOOLS},
])
def test_the_chat_schema_takes_the_new_fields(fields):
    ChatCompletionRequest.model_validate(chat(**fields))


@pytest.mark.parametrize("fields,where", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "text", "json_schema": {"name": "r"}}}, "response_format"),
    ({"structured_outputs": {"jsonschema": SCHEMA}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f"}}]}]}, "messages"),
])
def test_the_chat_schema_refuses_malformed_fields(fields, where):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(chat(**fields))
    assert info.value.errors()[0]["loc"][0] == where


def test_openapi_documents_the_fields():
    http, _, _ = fake_gateway(answer("x"))
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    assert {"response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls"} <= set(chat_fields)
    assert {"response_format", "structured_outputs"} <= set(schemas["CompletionRequest"]["properties"])
    assert "tools" not in schemas["CompletionRequest"]["properties"]
    assert "json" in schemas["StructuredOutputs"]["properties"] and "schema" in schemas["JsonSchema"]["properties"]
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]
    assert "tool_calls" in schemas["ChatDelta"]["properties"]


# ---- 400s that never reach the engine ----------------------------------------------------------

# As JSON text (json.dumps refuses to write it): 400 objects deep, which once took the gateway past Python's
# stack (a 500). Deeper still, the body parser refuses it.
DEEP = '{"type":"object","properties":{"a":' * 400 + '{"type":"integer"}' + '},"required":["a"]}' * 400

BAD = [
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}),
     "response_format", "response_format.json_schema.schema"),
    ("/v1/chat/completions", chat(structured_outputs={"json": "{not json"}), "structured_outputs", "not JSON"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "(a"}), "structured_outputs", "unclosed group"),
    ("/v1/chat/completions", chat(structured_outputs={"grammar": 'root ::= "a'}), "structured_outputs", "grammar"),
    ("/v1/chat/completions", chat(structured_outputs={"grammar": "start: foo"}), "structured_outputs", "foo"),
    ("/v1/chat/completions", chat(structured_outputs={}), "structured_outputs", "exactly one"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
     "exactly one"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
     "structured_outputs", "both constrain"),
    ("/v1/chat/completions", chat(guided_regex="a", guided_choice=["b"]), "guided_regex", "both constrain"),
    ("/v1/chat/completions", chat(guided_json={"type": "nope"}), "guided_json", "guided_json"),
    ("/v1/chat/completions", chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "response_format", "both constrain"),
    ("/v1/chat/completions", chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
     "tool_choice", "'fly'"),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice", "needs tools"),
    ("/v1/chat/completions", chat(tools=[TOOLS[0], TOOLS[0]]), "tools", "given twice"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]), "tools", "object"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], tool_choice="required"), "tools",
     "tools[0].function.parameters"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]), "tools", "tools[0].function.parameters"),
    ("/v1/chat/completions", json.dumps(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": "DEEP"}})).replace('"DEEP"', DEEP), "response_format", "nested too deeply"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format", "Unsatisfiable"),
    ("/v1/completions", {"prompt": "x", "tools": TOOLS}, "tools", None),
]


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400s_that_never_reach_the_engine(path, body, param, words):
    http, client, tokenizer = fake_gateway(answer("x"))
    response = (http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, str)
                else http.post(path, json=body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if words is not None:
        assert words in error["message"], error
    assert client.submitted == [] and tokenizer.rendered == []


# ---- the constraint published, and what the template gets ---------------------------------------

@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
     StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs(choice=["a", "b"])),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ({"tools": TOOLS}, None),
    ({"tools": TOOLS, "tool_choice": "none"}, None),
    ({"tools": TOOLS, "tool_choice": NAMED}, StructuredOutputs(json=WEATHER)),
])
def test_the_constraint_travels_with_every_choice(fields, expected):
    http, client, _ = fake_gateway(answer('{"ok":true}'))
    response = http.post("/v1/chat/completions", json=chat(n=2, **fields))
    assert response.status_code == 200, response.text
    want = expected.validate() if expected is not None else None
    assert [r.structured_outputs for r in client.submitted] == [want, want]
    if "tools" not in fields:  # completions take the same constraint fields (tools are chat's)
        completion = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, **fields})
        assert completion.status_code == 200 and client.submitted[-1].structured_outputs == want


def test_required_constrains_to_an_array_of_calls():
    http, client, _ = fake_gateway(answer('[{"name":"get_time","parameters":{}}]'))
    http.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(client.submitted[0].structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"]["properties"] == WEATHER["properties"]


def test_tools_and_tool_history_reach_the_chat_template():
    http, _, tokenizer = fake_gateway(answer("fine"))
    history = [{"role": "developer", "content": "be brief"}, *CHAT,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    assert http.post("/v1/chat/completions", json=chat(messages=history, tools=TOOLS)).status_code == 200
    messages, tools = tokenizer.rendered[-1]
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert tools[0] == {"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                                         "parameters": WEATHER}}
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}], "arguments as an object, for `tojson`"
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    http.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="none"))
    assert tokenizer.rendered[-1][1] is None, "tool_choice none: the template offers no tools"
    http.post("/v1/chat/completions", json=chat())
    assert tokenizer.rendered[-1][1] is None


# ---- tool calls in whole responses -------------------------------------------------------------

def whole(script, finish_reason: str = "stop", **fields) -> dict:
    http, _, _ = fake_gateway(script, finish_reason)
    response = http.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 200, response.text
    body = response.json()
    ChatCompletionResponse.model_validate(body)
    return body["choices"][0]


def test_a_named_function_is_one_call_with_the_output_as_arguments():
    """finish_reason "stop", not "tool_calls", as OpenAI answers a named tool_choice (vllm-project/vllm#25054)."""
    choice = whole(answer('{"city":', '"Paris"}'), tools=TOOLS, tool_choice=NAMED)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}


def test_required_calls_are_read_from_the_array():
    output = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    choice = whole(answer(output), tools=TOOLS, tool_choice="required")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    cut = whole(answer('[{"name":"get_wea'), "length", tools=TOOLS, tool_choice="required")
    assert cut == {**cut, "finish_reason": "length", "message": {"role": "assistant", "content": '[{"name":"get_wea'}}


def test_arguments_are_the_json_text_the_model_wrote():
    """Never parsed and written again: a float keeps its digits, and 1e999 (JSON, though no double holds
    it) does not become Infinity (not JSON)."""
    arguments = '{"city":"Oslo","days":1e999,"lat":0.12345678901234567890}'
    required = whole(answer(f'[{{"name":"get_weather","parameters":{arguments}}}]'), tools=TOOLS,
                     tool_choice="required")
    assert required["message"]["tool_calls"][0]["function"]["arguments"] == arguments
    auto = whole(answer(f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'), tools=TOOLS)
    assert auto["message"]["tool_calls"][0]["function"]["arguments"] == arguments
    as_string = whole(answer('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": 1}"}</tool_call>'), tools=TOOLS)
    assert as_string["message"]["tool_calls"][0]["function"]["arguments"] == '{"tz": 1}'
    bare = whole(answer('<tool_call>{"name": "get_time"}</tool_call>'), tools=TOOLS)
    assert bare["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_parameters_without_a_type_are_an_objects_schema():
    untyped = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    http, client, _ = fake_gateway(answer('{"a":1}'))
    http.post("/v1/chat/completions", json=chat(tools=untyped, tool_choice={"type": "function", "function": {"name": "f"}}))
    schema = json.loads(client.submitted[0].structured_outputs.json)
    assert schema["type"] == "object" and schema["properties"] == {"a": {"type": "integer"}}


def test_auto_reads_hermes_calls_and_keeps_plain_replies_as_content():
    output = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    choice = whole(answer(output), tools=TOOLS)
    # the text before the call as it is, as it streams (test_auto_streams_content_until_a_call_opens)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look.\n"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    plain = whole(answer("It is sunny."), tools=TOOLS)
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "It is sunny."}
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert whole(answer(unknown), tools=TOOLS)["message"] == {"role": "assistant", "content": unknown}


# ---- tool calls streamed -----------------------------------------------------------------------

def streamed(script, finish_reason: str = "stop", **fields) -> list[dict]:
    http, _, _ = fake_gateway(script, finish_reason)
    response = http.post("/v1/chat/completions", json=chat(stream=True, **fields))
    assert response.status_code == 200, response.text
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        ChatCompletionChunk.model_validate(chunk)
    return [chunk["choices"][0] for chunk in events[:-1] if chunk["choices"]]


def test_a_named_function_streams_its_arguments_as_they_come():
    choices = streamed(answer('{"ci', 'ty":"Pa', 'ris"}'), tools=TOOLS, tool_choice=NAMED)
    deltas = [c["delta"] for c in choices]
    assert deltas[0] == {"role": "assistant", "content": ""}
    head = deltas[1]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:] if d.get("tool_calls")]
    assert fragments[0] == '{"ci' and "".join(fragments) == '{"city":"Paris"}', "(later events arrive coalesced)"
    assert all("id" not in d["tool_calls"][0] for d in deltas[2:] if d.get("tool_calls"))
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "stop"  # as OpenAI streams it too
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    cut = streamed(answer('{"ci'), "length", tools=TOOLS, tool_choice=NAMED)
    assert cut[-1]["finish_reason"] == "length"


def test_required_streams_its_calls_once_the_array_is_whole():
    pieces = ['[{"name":"get_time",', '"parameters":{}},', '{"name":"get_weather","parameters":{"city":"Oslo"}}]']
    choices = streamed(answer(*pieces), tools=TOOLS, tool_choice="required")
    with_calls = [c["delta"]["tool_calls"] for c in choices if c["delta"].get("tool_calls")]
    assert len(with_calls) == 1, "one delta, at the end"
    calls = with_calls[0]
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert not any(c["delta"].get("content") for c in choices)
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_auto_streams_content_until_a_call_opens():
    pieces = ["Checking", " now <to", "ol_call>", '{"name": "get_time", ', '"arguments": {}}', "</tool_call>"]
    choices = streamed(answer(*pieces), tools=TOOLS)
    content = [c["delta"]["content"] for c in choices if c["delta"].get("content")]
    assert content == ["Checking", " now "], "the start of <tool_call> is held back, and nothing of it is sent"
    calls = [c["delta"]["tool_calls"] for c in choices if c["delta"].get("tool_calls")]
    assert calls == [[{"index": 0, "id": calls[0][0]["id"], "type": "function",
                       "function": {"name": "get_time", "arguments": "{}"}}]]
    assert choices[-1]["finish_reason"] == "tool_calls"
    plain = streamed(answer("a <b", "> <tool", "box"), tools=TOOLS)
    assert "".join(c["delta"].get("content") or "" for c in plain) == "a <b> <toolbox"
    assert plain[-1]["finish_reason"] == "stop" and not any(c["delta"].get("tool_calls") for c in plain)


def test_a_streamed_call_cut_short_is_content():
    choices = streamed(answer('[{"name":', '"get_ti'), "length", tools=TOOLS, tool_choice="required")
    assert "".join(c["delta"].get("content") or "" for c in choices) == '[{"name":"get_ti'
    assert choices[-1]["finish_reason"] == "length"


def test_held_back_logprobs_go_with_the_next_delta():
    pieces = ['[{"name":"get_time",', '"parameters":{}}]']
    choices = streamed(answer(*pieces), tools=TOOLS, tool_choice="required", logprobs=True)
    with_logprobs = [c for c in choices if c["logprobs"]]
    assert len(with_logprobs) == 1 and with_logprobs[0]["delta"].get("tool_calls")
    assert len(with_logprobs[0]["logprobs"]["content"]) == len("".join(pieces)), "one per token, none lost"


def test_structured_streams_without_tools_are_plain_content():
    choices = streamed(answer('{"ok":', "true}"), response_format={"type": "json_object"})
    assert json.loads("".join(c["delta"].get("content") or "" for c in choices)) == {"ok": True}
    assert choices[-1]["finish_reason"] == "stop"


def test_tool_stream_holds_back_only_what_may_open_a_call():
    stream = ToolStream(ToolUse([Tool(FunctionDefinition("f"))], "auto"))
    assert stream.add("x <") == [{"content": "x "}]
    assert stream.add("y") == [{"content": "<y"}]
    assert stream.add("<tool_cal") == []
    assert stream.add("l>{") == []
    assert stream.finish() == [{"content": "<tool_call>{"}] and not stream.called
    named = ToolStream(ToolUse([Tool(FunctionDefinition("f"))], NamedToolChoice(FunctionName("f"))))
    assert named.add("")[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert named.add("{}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    assert named.finish() == [] and named.called
