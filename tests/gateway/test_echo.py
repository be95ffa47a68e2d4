"""`echo` on /v1/completions, as OpenAI's legacy API and vLLM answer it, on the in-memory gateway (no stack):
with logprobs the prompt's tokens come first, the first without a logprob; with max_tokens 0 the prompt
alone. lm-eval-harness scores a continuation this way (echo, logprobs 1, max_tokens 1, temperature 0)."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_types import CompletionResponse
from tests.gateway.fakes import fake_gateway
from tests.gateway.helpers import sse_events

C = "/v1/completions"


def complete(body: dict, output: list[str] | None = None, finish_reason: str = "stop"):
    http, client, _ = fake_gateway(lambda request: output or ["ab"], finish_reason)
    response = http.post(C, json=body)
    return response, client


def test_echo_with_logprobs_puts_the_prompts_before_the_completions():
    response, client = complete({"prompt": "hey", "echo": True, "logprobs": 1, "max_tokens": 2})
    assert response.status_code == 200, response.text
    CompletionResponse.model_validate(response.json())
    choice = response.json()["choices"][0]
    assert client.submitted[0].prompt_logprobs == 1 and client.submitted[0].logprobs == 1
    assert choice["text"] == "heyab"
    lp = choice["logprobs"]
    assert lp["tokens"] == list("heyab")
    assert lp["token_logprobs"] == [None, -2.0, -2.0, -1.0, -1.0]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"\x00": -3.0, "e": -2.0}
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert response.json()["usage"]["completion_tokens"] == 2


def test_without_echo_or_logprobs_the_prompt_is_not_scored():
    for body in ({"prompt": "hey", "logprobs": 1}, {"prompt": "hey", "echo": True}):
        response, client = complete(body)
        assert response.status_code == 200 and client.submitted[0].prompt_logprobs is None
    response, _ = complete({"prompt": "hey", "echo": True})
    assert response.json()["choices"][0]["text"] == "heyab" and response.json()["choices"][0]["logprobs"] is None


def test_a_streamed_echo_sends_the_prompts_logprobs_in_its_first_chunk():
    http, _, _ = fake_gateway(lambda request: ["a", "b"])
    response = http.post(C, json={"prompt": "hey", "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True})
    chunks = [e for e in sse_events(response.content)[:-1]]
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == "heyab"
    first = choices[0]["logprobs"]
    assert first["tokens"][:3] == list("hey") and first["token_logprobs"][:3] == [None, -2.0, -2.0]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == list("heyab") and offsets == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_is_the_prompt_alone(stream):
    """vLLM's echo without generation: the engine makes one token, which is not returned nor counted."""
    http, client, _ = fake_gateway(lambda request: ["z"], "length")
    response = http.post(C, json={"prompt": "hey", "echo": True, "logprobs": 2, "max_tokens": 0, "stream": stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {})})
    assert response.status_code == 200, response.text
    assert client.submitted[0].max_tokens == 1
    if stream:
        chunks = sse_events(response.content)[:-1]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        finish, used = choices[-1]["finish_reason"], chunks[-1]["usage"]
    else:
        choice = response.json()["choices"][0]
        text, tokens, finish, used = choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"], \
            response.json()["usage"]
    assert (text, tokens, finish) == ("hey", list("hey"), "length")
    assert used["completion_tokens"] == 0 and used["prompt_tokens"] == 3


def test_max_tokens_0_without_echo_is_refused_by_name():
    response, client = complete({"prompt": "hey", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert "echo" in response.json()["error"]["message"] and not client.submitted
    http, _, _ = fake_gateway(lambda request: ["z"])
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert chat.status_code == 400 and json.loads(chat.text)["error"]["param"] == "max_tokens"
