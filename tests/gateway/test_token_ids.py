"""vLLM's extras that shape an answer, on the in-memory gateway (no stack): `return_token_ids` (the token ids
beside the text, which RL trainers read instead of tokenizing the text again), `return_tokens_as_token_ids`
(logprobs name `token_id:<id>`) and `stream_options.continuous_usage_stats` (usage on every chunk)."""

from __future__ import annotations

import pytest

from services.gateway.openai_types import (ChatCompletionChunk, ChatCompletionResponse, CompletionResponse)
from tests.gateway.fakes import fake_gateway
from tests.gateway.helpers import sse_events

C, CH = "/v1/completions", "/v1/chat/completions"
CHAT = [{"role": "user", "content": "hi"}]


def answer(path: str, body: dict, output: list[str] | None = None):
    http, client, tokenizer = fake_gateway(lambda request: output or ["ab", "c"])
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response, client


def test_a_completion_returns_each_choices_prompt_and_tokens():
    response, client = answer(C, {"prompt": ["hi", "yo"], "n": 2, "return_token_ids": True})
    body = response.json()
    CompletionResponse.model_validate(body)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[104, 105]] * 2 + [[121, 111]] * 2
    assert all(c["token_ids"] == [ord(x) for x in "abc"] and c["text"] == "abc" for c in body["choices"])
    plain, _ = answer(C, {"prompt": "hi"})
    assert "token_ids" not in plain.json()["choices"][0] and "prompt_token_ids" not in plain.json()["choices"][0]


def test_a_chat_returns_the_rendered_prompt_once_and_each_choices_tokens():
    response, client = answer(CH, {"messages": CHAT, "return_token_ids": True})
    body = response.json()
    ChatCompletionResponse.model_validate(body)
    assert body["prompt_token_ids"] == client.submitted[0].prompt_token_ids
    assert body["choices"][0]["token_ids"] == [ord(x) for x in "abc"]


@pytest.mark.parametrize("path,body", [(C, {"prompt": "hi"}), (CH, {"messages": CHAT})])
def test_a_stream_sends_each_events_tokens_and_the_prompt_first(path, body):
    response, client = answer(path, {**body, "stream": True, "return_token_ids": True})
    chunks = sse_events(response.content)[:-1]
    model = ChatCompletionChunk if path == CH else CompletionResponse
    for chunk in chunks:
        model.model_validate(chunk)
    tokens = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert tokens == [ord(x) for x in "abc"]
    first = chunks[0] if path == CH else chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == client.submitted[0].prompt_token_ids
    assert sum("prompt_token_ids" in (c if path == CH else c["choices"][0]) for c in chunks) == 1


def test_logprobs_can_name_token_ids():
    response, _ = answer(C, {"prompt": "hi", "logprobs": 1, "return_tokens_as_token_ids": True})
    lp = response.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{ord(x)}" for x in "abc"]
    assert all(set(top) <= {f"token_id:{ord(x)}" for x in "abc"} for top in lp["top_logprobs"])
    chat, _ = answer(CH, {"messages": CHAT, "logprobs": True, "return_tokens_as_token_ids": True})
    assert [c["token"] for c in chat.json()["choices"][0]["logprobs"]["content"]] == [f"token_id:{ord(x)}" for x in "abc"]


def test_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk():
    response, _ = answer(C, {"prompt": "hi", "n": 2, "stream": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = sse_events(response.content)[:-1]
    with_choices = [c for c in chunks if c["choices"]]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in with_choices)
    last = {}
    for c in with_choices:
        usage, index = c["usage"], c["choices"][0]["index"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] >= last.get(index, 0)
        last[index] = usage["total_tokens"]
    assert last == {0: 5, 1: 5} and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    plain, _ = answer(C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in sse_events(plain.content)[:-1] if c["choices"])


def test_tokens_a_tool_stream_holds_back_still_go_out():
    from tests.gateway.test_structured import TOOLS

    pieces = ["<tool", "_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"]
    response, _ = answer(CH, {"messages": CHAT, "tools": TOOLS, "stream": True, "return_token_ids": True}, pieces)
    chunks = sse_events(response.content)[:-1]
    tokens = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert tokens == [ord(x) for x in "".join(pieces)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
