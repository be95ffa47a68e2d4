"""What clients really send, on the in-memory gateway (tests/gateway/fakes.py): the openai SDK's own
assistant message sent back in the history, the neutral values of fields this server lacks (clients
that send every field), text JSON lets through that is no Unicode; and the streamed `text_offset`
of completions logprobs, which must equal the whole response's however the text is held back."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionMessage

from tests.gateway.fakes import fake_gateway


def test_the_sdks_assistant_message_sent_back_in_the_history_is_taken():
    http, client, tokenizer = fake_gateway(lambda request: ["ok"])
    said = ChatCompletionMessage(role="assistant", content="hello").model_dump()  # refusal, audio, ... = None
    assert {"refusal", "annotations", "audio", "function_call"} <= said.keys()
    parts = [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]
    response = http.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hi"}, said, {"role": "user", "content": parts}], "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert [m["content"] for m in tokenizer.rendered[-1][0]] == ["hi", "hello", "more"]


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "suffix", None), ("/v1/completions", "use_beam_search", False),
    ("/v1/completions", "prompt_logprobs", None), ("/v1/chat/completions", "functions", None),
    ("/v1/chat/completions", "function_call", None), ("/v1/chat/completions", "reasoning_effort", None),
    ("/v1/chat/completions", "audio", None), ("/v1/chat/completions", "use_beam_search", False),
])
def test_the_neutral_value_of_a_field_this_server_lacks_is_taken(path, field, value):
    http, _, _ = fake_gateway(lambda request: ["ok"])
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    assert http.post(path, json={**prompt, field: value, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body,words", [
    ({"prompt": "hi", "suffix": "x"}, "suffix (insertion) is not supported"),
    ({"prompt": "hi", "use_beam_search": True}, "beam search is not supported"),
    ({"prompt": "hi", "use_beam_search": 0}, "beam search is not supported"),
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages.0.refusal: unknown field"),
])
def test_any_other_value_is_still_refused_naming_the_field(body, words):
    http, client, _ = fake_gateway(lambda request: ["ok"])
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    response = http.post(path, json=body)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    assert client.submitted == []


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}'), ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
])
def test_a_lone_surrogate_is_a_400_not_a_500(path, body):
    http, client, _ = fake_gateway(lambda request: ["ok"])
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "not valid Unicode: a lone surrogate" in response.json()["error"]["message"]
    assert client.submitted == []


def test_detokenize_names_its_own_field():
    http, _, _ = fake_gateway(lambda request: [""])
    error = http.post("/detokenize", json={"tokens": [10 ** 6]}).json()["error"]
    assert error["param"] == "tokens" and error["message"].startswith("token id 1000000 is outside")


LAGGING = [("a", [ord("a")]), ("", [ord("b"), ord("c")]), ("bcd", [ord("d")]), ("ef", [ord("e"), ord("f")])]
"""Text held back while its tokens come (a stop string's possible start, part of a character)."""


@pytest.mark.parametrize("events", [["ab", "cd", "ef"], LAGGING], ids=["in-step", "lagging"])
def test_streamed_text_offsets_equal_the_whole_responses(events):
    """Every token's `text_offset` is the length of the token texts before it, in a stream as in the
    whole response, however far the text sent lags the tokens."""
    # one write per event: each delivered once the gateway took the one before (timed spacing, even
    # 0.25 s, let a fresh-clone CI run at nice 19 beside tests/reliability coalesce two into one write)
    http, _, _ = fake_gateway(lambda request: events, lockstep=True)
    body = {"prompt": "hi", "max_tokens": 8, "logprobs": 1}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["text_offset"]
    streamed, writes = [], 0
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                streamed += logprobs["text_offset"] if logprobs else []
                writes += 1
    assert writes >= len(events), "the events were not written one by one"
    assert streamed == whole == list(range(6))


def test_priority_reaches_every_request_of_the_call():
    http, client, _ = fake_gateway(lambda request: ["ok"])
    assert http.post("/v1/completions", json={"prompt": "hi", "n": 2, "priority": -3}).status_code == 200
    assert [r.priority for r in client.submitted] == [-3, -3]
    assert http.post("/v1/completions", json={"prompt": "hi", "priority": 2**31}).status_code == 400


def test_min_tokens_reaches_the_requests_and_past_max_tokens_is_a_400():
    http, client, _ = fake_gateway(lambda request: ["ok"])
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "min_tokens": 2}).status_code == 200
    assert client.submitted[-1].min_tokens == 2
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "min_tokens": 6})
    assert response.status_code == 400 and "min_tokens=6" in response.json()["error"]["message"]


def test_continue_final_message_renders_no_new_turn_and_is_checked():
    http, client, tokenizer = fake_gateway(lambda request: ["ok"])
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert "".join(map(chr, client.submitted[-1].prompt_token_ids)).endswith("assistant: Sure, the\n")
    for wrong, words in (({**body, "add_generation_prompt": True}, "needs add_generation_prompt false"),
                         ({**body, "messages": prefill[:1]}, "an assistant's; it is 'user'")):
        response = http.post("/v1/chat/completions", json=wrong)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def test_skip_special_tokens_and_include_stop_str_reach_the_requests():
    http, client, _ = fake_gateway(lambda request: ["ok"])
    body = {"prompt": "hi", "skip_special_tokens": False, "include_stop_str_in_output": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    sent = client.submitted[-1]
    assert (sent.skip_special_tokens, sent.include_stop_str_in_output) == (False, True)


def test_a_stop_token_id_outside_the_vocabulary_is_a_400():
    http, client, _ = fake_gateway(lambda request: ["ok"])
    response = http.post("/v1/completions", json={"prompt": "hi", "min_tokens": 1, "stop_token_ids": [10 ** 6]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop_token_ids"
    assert client.submitted == []


def test_min_tokens_past_the_default_max_tokens_names_both_and_its_field():
    http, _, _ = fake_gateway(lambda request: ["ok"])
    error = http.post("/v1/completions", json={"prompt": "hi", "min_tokens": 20}).json()["error"]
    assert error["param"] == "min_tokens" and "exceeds max_tokens (16" in error["message"], error


def test_a_lone_surrogate_in_a_chat_message_is_a_400_that_says_so():
    http, _, _ = fake_gateway(lambda request: ["ok"])
    response = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "messages.0.content is not valid Unicode" in response.json()["error"]["message"]
