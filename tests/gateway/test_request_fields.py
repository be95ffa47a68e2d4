"""The request fields as OpenAI's SDK and vLLM's clients send them, on the in-memory gateway (no stack):
null for an optional field is its default, OpenAI's fields that change nothing here are accepted, the ones
this server does not implement are refused by name, and every refusal says what to send instead."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.gateway.openai_types import NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest
from tests.gateway.fakes import fake_gateway

C, CH = "/v1/completions", "/v1/chat/completions"
CHAT = [{"role": "user", "content": "hi"}]


def post(path: str, body: dict):
    http, client, _ = fake_gateway(lambda request: ["ok"])
    return http.post(path, json=body), client


def sent(client) -> list[dict]:
    """What the gateway published, but for the request ids (each request gets a fresh one)."""
    return [{k: v for k, v in msgspec.structs.asdict(r).items() if k != "id"} for r in client.submitted]


def error_of(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


NULLABLE = ["temperature", "top_p", "top_k", "min_p", "n", "stream", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "seed", "stop", "max_tokens", "stream_options", "user",
            "response_format"]


@pytest.mark.parametrize("path,body,extra", [(C, {"prompt": "hi"}, ["echo", "logprobs", "best_of"]),
                                             (CH, {"messages": CHAT}, ["logprobs", "top_logprobs",
                                                                       "parallel_tool_calls", "tools",
                                                                       "tool_choice", "max_completion_tokens"])])
def test_null_for_an_optional_field_is_its_default(path, body, extra):
    """The OpenAI SDK sends null for an argument given as None; OpenAI and vLLM read it as the default."""
    plain, plain_client = post(path, body)
    nulls, null_client = post(path, {**body, **dict.fromkeys(NULLABLE + extra)})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert sent(null_client) == sent(plain_client), "null changed what was sent to the engine"
    assert null_client.submitted[0].temperature == 1.0 and null_client.submitted[0].top_p == 1.0


def test_null_in_a_nested_field_is_its_default_too():
    response, client = post(CH, {"messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
                                 "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "r", "schema": {"type": "object"},
                                                                     "strict": None, "description": None}}})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path,body,field", [(C, {"prompt": None}, "prompt"), (CH, {"messages": None}, "messages"),
                                             (CH, {"messages": [{"role": None, "content": "x"}]}, "messages")])
def test_null_for_a_required_field_is_still_refused(path, body, field):
    assert error_of(post(path, body)[0])["param"] == field


def test_the_schema_says_that_optional_fields_take_null():
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema()
        for name, prop in schema["properties"].items():
            if name not in schema.get("required", ()):
                assert {"type": "null"} in prop["anyOf"], (model.__name__, name, prop)
        for name in schema["required"]:
            assert {"type": "null"} not in schema["properties"][name].get("anyOf", ()), name


@pytest.mark.parametrize("path,body", [(C, {"prompt": "hi"}), (CH, {"messages": CHAT})])
def test_openai_fields_that_change_nothing_here_are_accepted(path, body):
    ignored = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u",
               "prompt_cache_key": "k", "safety_identifier": "s"}
    if path == CH:
        ignored["modalities"] = ["text"]
    response, client = post(path, {**body, **ignored})
    assert response.status_code == 200, response.text
    plain, plain_client = post(path, body)
    assert sent(client) == sent(plain_client)


@pytest.mark.parametrize("field,value", [("service_tier", "gold"), ("metadata", {"k": 1}), ("store", "yes")])
def test_those_fields_are_still_checked(field, value):
    assert error_of(post(C, {"prompt": "hi", field: value})[0])["param"] == field


def test_modalities_other_than_text_are_refused():
    assert error_of(post(CH, {"messages": CHAT, "modalities": ["text", "audio"]})[0])["param"] == "modalities"


@pytest.mark.parametrize("field,value", [("suffix", "x"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
                                         ("reasoning_effort", "low"), ("prediction", {"type": "content"}),
                                         ("audio", {}), ("prompt_logprobs", 1), ("use_beam_search", True)])
def test_fields_this_server_does_not_implement_are_refused_by_name(field, value):
    path, body = (C, {"prompt": "hi"}) if field == "suffix" else (CH, {"messages": CHAT})
    response, client = post(path, {**body, field: value})
    error = error_of(response)
    assert error["message"] == NOT_SUPPORTED[field] and error["param"] == field
    assert client.submitted == []


def test_an_unknown_field_is_named_and_the_schema_pointed_to():
    error = error_of(post(C, {"prompt": "hi", "temprature": 0.5})[0])
    assert error["message"] == "temprature: unknown field (the fields this server takes are in /openapi.json)"
    assert error["param"] == "temprature"
    nested = error_of(post(C, {"prompt": "hi", "stream": True, "stream_options": {"usage": True}})[0])
    assert nested["message"].startswith("stream_options.usage: unknown field")


@pytest.mark.parametrize("prompt", [5, ["a", 1], [-1], [[1], "a"], {"text": "a"}])
def test_a_prompt_of_no_accepted_form_lists_the_forms_once(prompt):
    error = error_of(post(C, {"prompt": prompt})[0])
    assert error["message"] == ("prompt: must be a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids (token ids >= 0, at most 32 prompts)"), error
    assert error["param"] == "prompt"


def test_a_stop_of_no_accepted_form_lists_the_forms():
    error = error_of(post(C, {"prompt": "hi", "stop": 5})[0])
    assert error["message"] == "stop: must be a string or a list of at most 16 non-empty strings"


def test_an_empty_text_prompt_is_refused_only_if_it_tokenizes_to_nothing():
    """The fake tokenizer adds no BOS: "" is no token. (One that adds BOS serves it: tests/gateway/test_http.py.)"""
    error = error_of(post(C, {"prompt": ""})[0])
    assert error["message"] == "the prompt is empty after tokenization" and error["param"] == "prompt"
    assert error_of(post(C, {"prompt": ["a", ""]})[0])["param"] == "prompt"


@pytest.mark.parametrize("seed,first", [(-1, 2**63 - 1), (-2**63, 0), (2**63 - 1, 2**63 - 1)])
def test_any_64_bit_signed_seed_is_taken_and_each_choice_gets_its_own(seed, first):
    response, client = post(C, {"prompt": "hi", "seed": seed, "n": 2})
    assert response.status_code == 200, response.text
    assert [r.seed for r in client.submitted] == [first, (first + 1) % 2**63]


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**63])
def test_a_seed_outside_64_bits_is_refused(seed):
    assert error_of(post(C, {"prompt": "hi", "seed": seed})[0])["param"] == "seed"


def test_logit_bias_reaches_the_engine_by_token_id():
    response, client = post(C, {"prompt": "hi", "logit_bias": {"42": 100, "7": -2.5}})
    assert response.status_code == 200, response.text
    assert client.submitted[0].logit_bias == {42: 100.0, 7: -2.5}
    _, chat_client = post(CH, {"messages": CHAT, "logit_bias": {"42": -100}})
    assert chat_client.submitted[0].logit_bias == {42: -100.0}


@pytest.mark.parametrize("bias,words", [({"abc": 1}, "'abc' is not a token id"), ({"-1": 1}, "'-1' is not a token id"),
                                        ({str(0x3000): 1}, "is not a token id of the vocabulary [0, 12288)"),
                                        ({"1": 101}, "less than or equal to 100"), ({"1": "x"}, "valid number")])
def test_a_bad_logit_bias_is_a_400_naming_it(bias, words):
    response, client = post(C, {"prompt": "hi", "logit_bias": bias})
    error = error_of(response)
    assert error["param"] == "logit_bias" and words in error["message"], error
    assert client.submitted == []


def test_chat_template_kwargs_reach_the_template_on_chat_and_tokenize():
    """vLLM's chat_template_kwargs ({"enable_thinking": false} for Qwen3-style templates), also on /tokenize
    (so its count is chat's); a key the rendering itself sets is a 400 naming the field."""
    http, client, tokenizer = fake_gateway(lambda request: ["ok"])
    kwargs = {"enable_thinking": False, "custom": [1, "x"]}
    assert http.post(CH, json={"messages": CHAT, "chat_template_kwargs": kwargs}).status_code == 200
    assert http.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": kwargs}).status_code == 200
    assert tokenizer.template_kwargs == [kwargs, kwargs]
    response = http.post(CH, json={"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    error = error_of(response)
    assert error["param"] == "chat_template_kwargs" and "add_generation_prompt" in error["message"]
    assert len(client.submitted) == 1


def test_allowed_token_ids_reach_the_engine_and_must_be_in_the_vocabulary():
    response, client = post(C, {"prompt": "hi", "allowed_token_ids": [5, 7]})
    assert response.status_code == 200 and client.submitted[0].allowed_token_ids == (5, 7)
    error = error_of(post(C, {"prompt": "hi", "allowed_token_ids": [5, 10 ** 6]})[0])
    assert error["param"] == "allowed_token_ids" and "vocabulary" in error["message"]
    assert error_of(post(CH, {"messages": CHAT, "allowed_token_ids": []})[0])["param"] == "allowed_token_ids"


def test_add_special_tokens_and_truncate_prompt_tokens_shape_the_prompt():
    """vLLM's add_special_tokens (completions and /tokenize: the tokenizer's own, as by default) and
    truncate_prompt_tokens (the prompt's last k tokens, -1 as many as the context holds; an echo then echoes
    what was kept)."""
    http, client, tokenizer = fake_gateway(lambda request: ["ok"])
    http.post(C, json={"prompt": "hi", "add_special_tokens": False})
    http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    http.post(C, json={"prompt": "hi"})
    assert tokenizer.special == [False, False, True]
    echoed = http.post(C, json={"prompt": "hello", "truncate_prompt_tokens": 3, "echo": True}).json()
    assert client.submitted[-1].prompt_token_ids == [ord(c) for c in "llo"] and echoed["choices"][0]["text"] == "llook"
    assert echoed["usage"]["prompt_tokens"] == 3
    http.post(CH, json={"messages": CHAT, "truncate_prompt_tokens": 2})
    assert len(client.submitted[-1].prompt_token_ids) == 2
    http.post(C, json={"prompt": "hello", "truncate_prompt_tokens": -1})
    assert client.submitted[-1].prompt_token_ids == [ord(c) for c in "hello"]
    assert error_of(http.post(C, json={"prompt": "hi", "truncate_prompt_tokens": 0}))["param"] == "truncate_prompt_tokens"
    refused = error_of(http.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}))
    assert refused["param"] == "add_special_tokens"


def test_documents_reach_a_retrieval_chat_template():
    http, client, tokenizer = fake_gateway(lambda request: ["ok"])
    documents = [{"title": "t", "text": "Paris is in France."}]
    assert http.post(CH, json={"messages": CHAT, "documents": documents}).status_code == 200
    assert tokenizer.documents == [documents]


@pytest.mark.parametrize("path,body", [(C, {"prompt": "hi"}), (CH, {"messages": CHAT})])
def test_vllms_fields_in_their_neutral_values_are_accepted_and_others_say_what_to_do(path, body):
    for field, value in (("spaces_between_special_tokens", True), ("length_penalty", 1.0), ("bad_words", []),
                         ("request_id", None), ("prompt_logprobs", None)):
        response, _ = post(path, {**body, field: value})
        assert response.status_code == 200, (field, response.text)
    for field, value, words in (("spaces_between_special_tokens", False, "special tokens"),
                                ("length_penalty", 0.5, "beam search"), ("bad_words", ["x"], "logit_bias"),
                                ("request_id", "r1", "own id"),
                                ("prompt_logprobs", 1, "echo")):
        error = error_of(post(path, {**body, field: value})[0])
        assert error["param"] == field and words in error["message"], error
    if path == CH:
        for field, value in (("add_special_tokens", False), ("echo", False), ("chat_template", None)):
            assert post(path, {**body, field: value})[0].status_code == 200
        assert "template" in error_of(post(path, {**body, "add_special_tokens": True})[0])["message"]
        assert "--chat-template" in error_of(post(path, {**body, "chat_template": "{{x}}"})[0])["message"]


def test_cache_salt_reaches_the_engine():
    response, client = post(C, {"prompt": "hi", "cache_salt": "tenant-a-1f9c"})
    assert response.status_code == 200 and client.submitted[0].cache_salt == "tenant-a-1f9c"
    assert error_of(post(CH, {"messages": CHAT, "cache_salt": ""})[0])["param"] == "cache_salt"
