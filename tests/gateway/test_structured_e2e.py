"""Structured outputs and tool calling end to end: the real stack (`orca serve`: nats-server, Ray, the
engine with its random-weight demo model, the Ray Serve gateway) through the real `openai` client.

A random-weight model writes whatever the constraint lets it, so every output here is only valid
because the engine masked everything else. The schemas bound every string (maxLength), array
(maxItems) and integer (minimum/maximum), so that each output has an end the model must reach;
max_tokens is far above it, and a `length` finish is a failure."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.gateway.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

MAX_TOKENS = 400
"""Far above the longest output any schema here allows (in tokens: at most one per character)."""

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 20}}, "required": ["name", "age"]},
    "paint": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["color", "shade"]},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"]},
    "account": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3}},
            "required": ["id", "roles"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "points": {"type": "object", "properties": {
        "points": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]}}},
        "required": ["points"]},
    "status": {"type": "object", "properties": {
        "status": {"const": "ok"}, "code": {"type": "integer", "minimum": 200, "maximum": 599},
        "note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["status", "code", "note"]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "either": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5}]}},
        "required": ["value"]},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
               "minItems": 2, "maxItems": 5},
    "label": {"type": "object", "properties": {
        "level": {"enum": [1, 2, 3]}, "flag": {"type": "boolean"},
        "label": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["level", "flag", "label"]},
}
PROMPTS = ["Describe a person.", "Pick a paint.", "Tag this post.", "Show the account.", "Plot some points.",
           "Report status.", "Nest it.", "Give a value.", "Score the runs.", "Label it."]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": TIME}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def cases() -> list[dict]:
    """50 json_schema requests: every schema five times, half streamed, greedy or seeded sampling."""
    out = []
    for i in range(50):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        sampling = {"temperature": 0} if i % 3 == 0 else {"temperature": 1.0, "seed": 1000 + i}
        out.append({"name": name, "prompt": PROMPTS[i % len(PROMPTS)] + f" #{i}", "stream": i % 2 == 1, **sampling})
    return out


async def one_json(client: openai.AsyncOpenAI, case: dict) -> tuple[str, str | None]:
    """(output text, finish reason) of one json_schema chat request, streamed or not."""
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": case["prompt"]}], max_tokens=MAX_TOKENS,
                  temperature=case["temperature"], seed=case.get("seed"),
                  response_format={"type": "json_schema", "json_schema": {
                      "name": case["name"], "schema": SCHEMAS[case["name"]], "strict": True}})
    if not case["stream"]:
        out = await client.chat.completions.create(**kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_fifty_json_schema_requests_all_validate(gateway):
    async def go():
        client = openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one_json(client, case) for case in cases()))
        finally:
            await client.close()
    results = asyncio.run(go())
    failures = []
    for case, (text, finish) in zip(cases(), results):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), SCHEMAS[case["name"]])
        except (AssertionError, json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append(f"{case['name']} (stream={case['stream']}, {case['temperature']}): "
                            f"{type(exc).__name__}: {str(exc)[:120]} <- {text[:160]!r}")
    assert not failures, f"{len(failures)}/50 invalid:\n" + "\n".join(failures)


def test_greedy_structured_output_is_the_same_streamed_or_not(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Pick a paint."}], max_tokens=MAX_TOKENS,
                  temperature=0, response_format={"type": "json_schema", "json_schema": {
                      "name": "paint", "schema": SCHEMAS["paint"]}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert whole == streamed
    jsonschema.validate(json.loads(whole), SCHEMAS["paint"])


REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{3,8}@[a-z]{2,5}\.com", r"#[0-9a-f]{6}", r"[A-Z][a-z]{1,6} [0-9]{1,2}"]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_match(client, regex):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Answer."}],
                                          max_tokens=64, temperature=1.0, seed=3,
                                          extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, chat.choices[0].message.content), chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=64, temperature=0,
                                           extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, completion.choices[0].text), completion.choices[0].text
    stream = client.completions.create(model=MODEL_NAME, prompt="y = ", max_tokens=64, temperature=1.0, seed=5,
                                       stream=True, extra_body={"guided_regex": regex})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(regex, text), text


def test_choice_outputs_are_one_of_the_choices(client):
    choices = ["Paris", "London", "Tokyo", "New York"]
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "A city?"}],
                                             max_tokens=16, temperature=1.0, seed=seed, n=2,
                                             extra_body={"structured_outputs": {"choice": choices}})
        assert all(c.message.content in choices and c.finish_reason == "stop" for c in out.choices), out.choices


def test_a_grammar_output_parses(client):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    out = client.completions.create(model=MODEL_NAME, prompt="sum: ", max_tokens=64, temperature=1.0, seed=11,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    text = out.choices[0].text
    if out.choices[0].finish_reason == "stop":  # `+ num` may repeat up to max_tokens
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*(\+[1-9]?)?", text), text


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in PARAMETERS and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


def test_tool_choice_required_calls_a_given_function_with_valid_arguments(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            check_call(call)
    single = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1


def test_tool_choice_required_streamed(client):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Weather and time?"}], tools=TOOLS,
            tool_choice="required", max_tokens=MAX_TOKENS, temperature=1.0, seed=9, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), PARAMETERS[entry["name"]])


def test_a_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice=named, max_tokens=MAX_TOKENS, temperature=0)
    [call] = out.choices[0].message.tool_calls
    check_call(call, "get_weather")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content is None  # OpenAI's answer

    arguments, names, finish = "", [], None
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
            tool_choice=named, max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            names.append(delta.function.name)
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names[0] == "get_weather" and arguments == call.function.arguments, "greedy: as the whole response"
    assert finish == "stop"


def test_tool_history_is_accepted(client):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_constraints_are_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object", "properties": {
                                               "a": {"type": "strin"}}}}})
    assert "response_format.json_schema.schema" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert "'fly'" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(a"}})


def test_a_gateway_renders_chats_with_its_chat_template_file(gateway, demo_model, tmp_path):
    """`python -m services.gateway --chat-template FILE` (uvicorn, beside the stack's own gateway)."""
    import httpx

    from engine.tokenizer import load_tokenizer
    from tests.gateway.helpers import GatewayProcess

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>")
    chat = [{"role": "user", "content": "print hello"}]
    expected = load_tokenizer(demo_model, str(template)).apply_chat_template(chat)
    assert expected != load_tokenizer(demo_model).apply_chat_template(chat)
    process = GatewayProcess(gateway.nats_url, demo_model, "--chat-template", str(template))
    try:
        assert httpx.post(process.http_url + "/tokenize", json={"messages": chat}).json()["tokens"] == expected
        out = httpx.post(process.http_url + "/v1/chat/completions", timeout=60,
                         json={"messages": chat, "max_tokens": 3, "temperature": 0}).json()
        assert out["usage"]["prompt_tokens"] == len(expected)
    finally:
        process.stop()
