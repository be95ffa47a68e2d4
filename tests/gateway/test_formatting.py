"""The gateway's pure parts, no stack: max_tokens and context rules, error mapping, logprobs shapes,
the status board's judgement. (Everything with NATS and HTTP is in the slow modules.)"""

from __future__ import annotations

import msgspec
import pytest

from services.gateway.engine_client import Event, StatusBoard
from services.gateway.errors import APIError, from_generation_error
from services.gateway.openai_types import ChatCompletionResponse, CompletionResponse
from services.gateway.prompts import resolve_max_tokens
from services.gateway.responses import Choice, Echo, chat_logprobs, chat_response, completion_logprobs, completion_response
from shared.messages import AdmissionStatus, EngineStatus, TokenizerStatus
from tests.gateway.fakes import fake_gateway

TOKENS = {1: "a", 2: "bc", 3: "é"}
ENTRIES = [{"token_id": 1, "logprob": -0.5, "top_logprobs": [{"token_id": 1, "logprob": -0.5},
                                                             {"token_id": 2, "logprob": -1.5}]},
           {"token_id": 3, "logprob": -0.25, "top_logprobs": []}]


def test_max_tokens_defaults_and_context_rules():
    assert resolve_max_tokens(10, None, 1024, 16) == 16
    assert resolve_max_tokens(1020, None, 1024, 16) == 4, "the default is capped by the room left"
    assert resolve_max_tokens(24, None, 1024, None) == 1000, "chat: the rest of the context"
    assert resolve_max_tokens(24, None, 1024, None, capacity=512) == 488, "... and of the KV cache"
    assert resolve_max_tokens(24, 1000, 1024, None) == 1000
    with pytest.raises(APIError) as info:
        resolve_max_tokens(24, 1001, 1024, None)
    assert info.value.status == 400 and "1024" in info.value.message and "1025" in info.value.message
    with pytest.raises(APIError) as info:
        resolve_max_tokens(1024, None, 1024, 16)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"


@pytest.mark.parametrize("text,retry,status,retry_after", [
    ("the admission queue is full (2 requests); retry later", True, 429, "1"),
    ("prompt has 1100 tokens; the model's context is 1024, leaving no room to generate", False, 400, None),
    ("request needs 9000 KV slots (prompt + max_tokens) but the cache holds 4096", False, 400, None),
    ("prompt token id 99999 is outside the vocabulary [0, 4096)", False, 400, None),
    ("engine 0 failed: WorkerDied", False, 503, None), ("engine 1 is not ready", False, 503, None),
    (None, False, 503, None),
    # a cause that passes is never the request's fault, whatever its words
    ("no engine has been available for 60 s; retry later", True, 503, "5"),
    ("this orca-serve instance is shutting down; retry later", True, 503, "5"),
    ("the engine no longer had this request's outputs: it must be sent again", True, 503, "5"),
])
def test_generation_errors_map_to_the_right_status(text, retry, status, retry_after):
    error = from_generation_error(text, retry)
    assert error.status == status
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.headers.get("Retry-After") == retry_after


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body,content_type,words", [
    (b'{"prompt": "hi" ', "application/json", "malformed JSON body at character 16: Expecting ',' delimiter"),
    (b"", "application/json", "the request has no body"),
    (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "send it with Content-Type: application/json"),
    (b"[1, 2]", "application/json", "the body must be a JSON object, not list"),
])
def test_a_body_that_is_no_json_object_is_a_400_that_says_why(path, body, content_type, words):
    http, client, _ = fake_gateway(lambda request: ["x"])
    response = http.post(path, content=body, headers={"content-type": content_type})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["param"] is None and error["type"] == "invalid_request_error", error
    assert client.submitted == []


def test_logprobs_in_openai_shapes():
    completion = completion_logprobs(ENTRIES, TOKENS.get)
    assert completion == {"tokens": ["a", "é"], "token_logprobs": [-0.5, -0.25],
                          "top_logprobs": [{"a": -0.5, "bc": -1.5}, {"é": -0.25}], "text_offset": [0, 1]}
    chat = chat_logprobs(ENTRIES, TOKENS.get)["content"]
    assert chat[1] == {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9], "top_logprobs": []}
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["a", "bc"]
    array_like = [[1, -0.5, [[2, -1.5]]]]  # TokenLogprob as msgspec sends it (array_like)
    assert completion_logprobs(array_like, TOKENS.get)["top_logprobs"] == [{"bc": -1.5, "a": -0.5}], \
        "the sampled token is in its position's dict (OpenAI: up to logprobs + 1 entries)"


def test_whole_responses_match_their_models():
    choice = Choice()
    prompt = [{"token_id": 3, "logprob": -0.5, "top_logprobs": []}]  # the prompt is [1, 3]
    for event in (Event("r-0", [1], "a", None, logprobs=ENTRIES[:1], prompt_logprobs=prompt),
                  Event("r-0", [3], "é", "length", logprobs=ENTRIES[1:], usage={"prompt_tokens": 2,
                                                                                  "completion_tokens": 2})):
        choice.add(msgspec.convert(msgspec.to_builtins(event), Event))
    body = completion_response("cmpl-1", 1, "m", [choice], [2], Echo(["p: "], [1]), TOKENS.get, True)
    CompletionResponse.model_validate(body)
    assert body["choices"][0]["text"] == "p: aé" and body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                                        "total_tokens": 4}
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [TOKENS[1], TOKENS[3], TOKENS[1], TOKENS[3]]
    assert lp["token_logprobs"][:2] == [None, -0.5] and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, len(TOKENS[1]), len(TOKENS[1] + TOKENS[3]), len(TOKENS[1] * 2 + TOKENS[3])]
    chat = chat_response("chatcmpl-1", 1, "m", [choice], [3], TOKENS.get, True)
    ChatCompletionResponse.model_validate(chat)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "aé"}


def test_status_board_health_and_queue():
    board = StatusBoard()
    assert not board.healthy and not board.queue_full and board.max_model_len() is None
    board.on_admission(AdmissionStatus(queue_len=0, max_queue_len=2, num_engines_ready=1))
    board.on_engine(EngineStatus(replica="0", incarnation="i", ready=True, block_size=16, num_blocks=100,
                                 admissible_blocks=100, num_running=0, num_waiting=0, max_num_seqs=4,
                                 max_model_len=512, last_admit_sequence=0, iteration=0, kv_used_blocks=0))
    board.on_tokenizer(TokenizerStatus("t", num_active=0))
    assert board.healthy and not board.queue_full
    board.on_admission(AdmissionStatus(queue_len=2, max_queue_len=2, num_engines_ready=1))
    assert board.queue_full
    assert board.max_model_len() == 512 and board.kv_capacity_tokens() == 1600
    board.admission_at -= 60  # stale: not believed
    assert not board.healthy and not board.queue_full


def test_a_request_whose_client_left_before_any_response_counts_as_499_not_500():
    import asyncio
    from collections import Counter

    from services.gateway.middleware import CountResponses, OpenRequests

    async def left(scope, receive, send):  # waits for its answer; the client hangs up meanwhile
        assert (await receive())["type"] == "http.disconnect"

    async def cancelled(scope, receive, send):
        raise asyncio.CancelledError

    async def failed(scope, receive, send):
        raise RuntimeError("a bug")

    async def answered(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def run(app) -> Counter:
        counts = Counter()
        middleware = CountResponses(app, counts, OpenRequests())

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            return None
        try:
            await middleware({"type": "http", "route": None}, receive, send)
        except (asyncio.CancelledError, RuntimeError):
            pass
        return counts

    codes = {app.__name__: set(code for _, code in asyncio.run(run(app))) for app in (left, cancelled, failed, answered)}
    assert codes == {"left": {499}, "cancelled": {499}, "failed": {500}, "answered": {200}}


def test_the_context_served_is_the_cache_where_the_cache_holds_fewer_tokens():
    """`--kv-cache-tokens 512` under a 1,024-token context: no request past 512 tokens can ever run, so
    /v1/models and the context-length 400 say 512 (vLLM refuses to start so; orca serves the cache's)."""
    board = StatusBoard()
    board.on_admission(AdmissionStatus(queue_len=0, max_queue_len=8, num_engines_ready=2))
    for replica, blocks in (("0", 32), ("1", 16)):  # x 16 slots: 512 and 256 tokens
        board.on_engine(EngineStatus(replica=replica, incarnation="i", ready=True, block_size=16, num_blocks=blocks,
                                     admissible_blocks=blocks, num_running=0, num_waiting=0, max_num_seqs=4,
                                     max_model_len=1024, last_admit_sequence=0, iteration=0, kv_used_blocks=0))
    assert board.max_model_len() == 512
    with pytest.raises(APIError) as info:
        resolve_max_tokens(500, 13, board.max_model_len(), None)
    assert "maximum context length is 512 tokens" in info.value.message
