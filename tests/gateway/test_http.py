"""Raw HTTP against the gateway of a real `orca serve`: SSE framing, error bodies for dozens of bad
inputs (never a 5xx), body limits, the small routes, abort, and clients that go away."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import nats
import pytest

from tests.gateway.conftest import MODEL_NAME
from shared import subjects
from tests.gateway.helpers import sse_events
from tests.services.stack import engine_statuses, worker_pids

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "hi"}]
LONG = {"prompt": "x = 1", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.http_url, timeout=60) as client:
        yield client


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 3, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, **fields}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
BAD = [
    (C, b"not json", 400, None), (C, b"[1, 2]", 400, None), (C, b"{}", 400, "prompt"), (C, b"", 400, None),
    (C, completion(prompt=[]), 400, "prompt"),
    (C, completion(prompt=[[]]), 400, "prompt"), (C, completion(prompt=[-1]), 400, "prompt"),
    (C, completion(prompt=[999999]), 400, "prompt"), (C, completion(prompt=5), 400, "prompt"),
    (C, completion(prompt=["a", 1]), 400, "prompt"), (C, completion(prompt=["a"] * 33), 400, "prompt"),
    (C, completion(prompt=[5] * 1100), 400, "prompt"),
    (C, completion(max_tokens=0), 400, "max_tokens"), (C, completion(max_tokens=-1), 400, "max_tokens"),
    (C, completion(max_tokens="5"), 400, "max_tokens"), (C, completion(max_tokens=1.5), 400, "max_tokens"),
    (C, completion(max_tokens=5000), 400, "max_tokens"), (C, completion(max_tokens=2**70), 400, "max_tokens"),
    (C, completion(temperature=-1), 400, "temperature"), (C, completion(temperature=3), 400, "temperature"),
    (C, completion(temperature="hot"), 400, "temperature"), (C, completion(top_p=0), 400, "top_p"),
    (C, completion(top_p=1.5), 400, "top_p"), (C, completion(top_k=-2), 400, "top_k"),
    (C, completion(min_p=2), 400, "min_p"), (C, completion(n=0), 400, "n"), (C, completion(n=17), 400, "n"),
    (C, completion(n=True), 400, "n"), (C, completion(seed=-2**63 - 1), 400, "seed"), (C, completion(seed=2**64), 400, "seed"),
    (C, completion(stop=[""]), 400, "stop"), (C, completion(stop=["s"] * 17), 400, "stop"),
    (C, completion(stop=5), 400, "stop"), (C, completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (C, completion(presence_penalty=3), 400, "presence_penalty"),
    (C, completion(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, completion(repetition_penalty=0), 400, "repetition_penalty"), (C, completion(logprobs=21), 400, "logprobs"),
    (C, completion(bogus=1), 400, "bogus"), (C, completion(model="nope"), 404, "model"),
    (C, completion(logit_bias={"999999": 2.0}), 400, "logit_bias"), (C, completion(best_of=2), 400, "best_of"),
    (C, completion(suffix="x"), 400, "suffix"), (C, completion(stream_options={"include_usage": True}), 400, None),
    (C, completion(stream="yes"), 400, "stream"), (C, completion(echo=1), 400, "echo"),
    (C, completion(user=5), 400, "user"),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (C, completion(stream=True, max_tokens=5000), 400, "max_tokens"),
    (CH, {"model": MODEL_NAME, "messages": []}, 400, "messages"), (CH, {"model": MODEL_NAME}, 400, "messages"),
    (CH, chat(messages="hi"), 400, "messages"),
    (CH, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    (CH, chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    (CH, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages"),
    (CH, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CH, chat(max_tokens=2000), 400, "max_tokens"),
    (CH, chat(max_completion_tokens=2000), 400, "max_completion_tokens"),
    (CH, chat(top_logprobs=3), 400, "top_logprobs"), (CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CH, chat(response_format={"type": "json_schema"}), 400, "response_format"),
    (CH, chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "strin"}}}),
     400, "response_format"),
    (CH, chat(structured_outputs={"regex": "(a"}), 400, "structured_outputs"),
    (C, completion(structured_outputs={"grammar": "start: foo"}), 400, "structured_outputs"),
    (CH, chat(tools=[{"type": "function"}]), 400, "tools"), (CH, chat(model="nope"), 404, "model"),
    (CH, chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (CH, chat(stream=True, max_tokens=2000), 400, "max_tokens"),
    (TOK, {}, 400, None), (TOK, {"prompt": "a", "messages": CHAT}, 400, None), (TOK, {"prompt": 5}, 400, "prompt"),
    (DETOK, {"tokens": [-1]}, 400, "tokens"), (DETOK, {"tokens": [999999]}, 400, None),
    (DETOK, {"tokens": [1], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_with_an_openai_error_body(http, path, body, status, param):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert_error(response, status, param)


def test_context_errors_name_both_numbers(http):
    error = assert_error(http.post(C, json=completion(prompt=[5] * 1000, max_tokens=100)), 400, "max_tokens")
    assert "1024" in error["message"] and "1100" in error["message"] and error["code"] == "context_length_exceeded"


def test_routes_and_methods_that_do_not_exist(http):
    assert_error(http.get("/nope"), 404)
    assert_error(http.get(C), 405)
    assert_error(http.post("/v1/abort/cmpl-unknown"), 404)


def test_oversized_bodies_are_refused_before_parsing(http):
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    assert_error(http.post(C, content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(5):
            yield b"a" * (1024 * 1024)
    assert_error(http.post(C, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_sse_framing_completions_and_chat(http):
    with http.stream("POST", C, json=completion(max_tokens=5, n=2, stream=True,
                                                stream_options={"include_usage": True})) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read())
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    finished = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(ch["index"] for ch in finished) == [0, 1]

    with http.stream("POST", CH, json=chat(max_tokens=4, stream=True)) as response:
        events = sse_events(response.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks) and {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_an_empty_prompt_is_served_from_the_bos_its_tokenizer_adds(http):
    """As vLLM serves it; a prompt that tokenizes to nothing is refused (tests/gateway/test_request_fields.py)."""
    out = http.post(C, json=completion(prompt="", max_tokens=2, temperature=0, logprobs=None)).json()
    assert out["usage"]["prompt_tokens"] == 1 and out["choices"][0]["finish_reason"] == "length", out


def test_the_openai_sdk_sends_none_as_null_and_it_means_the_default(http):
    """`client.completions.create(temperature=None, ...)` puts null in the body."""
    body = completion(prompt="def main():", max_tokens=4, temperature=0)
    plain = http.post(C, json=body).json()["choices"][0]["text"]
    nulls = http.post(C, json={**body, "top_p": None, "n": None, "stream": None, "echo": None, "seed": None}).json()
    assert nulls["choices"][0]["text"] == plain


def test_logit_bias_forces_a_token_over_http(http):
    forced = http.post(C, json=completion(prompt=[1, 2, 3], max_tokens=3, temperature=0, logit_bias={"42": 100}))
    assert forced.status_code == 200, forced.text
    text = http.post(DETOK, json={"tokens": [42, 42, 42]}).json()["prompt"]
    assert forced.json()["choices"][0]["text"] == text


def test_echo_and_stop(http):
    out = http.post(C, json=completion(prompt="def main():", max_tokens=4, temperature=0, echo=True)).json()
    assert out["choices"][0]["text"].startswith("def main():")
    full = http.post(C, json=completion(max_tokens=30, temperature=0)).json()["choices"][0]["text"]
    stop = full[10:13]
    cut = http.post(C, json=completion(max_tokens=30, temperature=0, stop=["\u2603", stop])).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.index(stop)]
    assert cut["stop_reason"] == stop, "vLLM's stop_reason: the stop string that ended it"


def test_stop_reason_is_the_stop_string_or_token_id_and_null_otherwise(http):
    forced = completion(prompt=[1, 2, 3], max_tokens=5, temperature=0, logit_bias={"42": 100})
    ended = http.post(C, json={**forced, "stop_token_ids": [7, 42]}).json()["choices"][0]
    assert (ended["finish_reason"], ended["stop_reason"]) == ("stop", 42)
    assert http.post(C, json=forced).json()["choices"][0]["stop_reason"] is None, "ended by its length"
    streamed = sse_events(http.post(C, json={**forced, "stop_token_ids": [42], "stream": True}).content)
    last = [e for e in streamed if isinstance(e, dict)][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", 42)
    full = http.post(CH, json=chat(max_tokens=30, temperature=0)).json()["choices"][0]["message"]["content"]
    stop = full[4:7]
    cut = http.post(CH, json=chat(max_tokens=30, temperature=0, stop=stop)).json()["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
    streamed = sse_events(http.post(CH, json=chat(max_tokens=30, temperature=0, stop=stop, stream=True)).content)
    chunks = [e for e in streamed if isinstance(e, dict) and e["choices"]]
    assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == ("stop", stop)


def test_health_metrics_models(http):
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["num_engines_ready"] == 1
    http.post(C, json=completion(temperature=-5))
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'orca:http_requests_total{route="/v1/completions",code="400"}' in text
    assert "orca:admission_queue_len 0" in text and "orca:num_engines_ready 1" in text
    assert "# TYPE orca:http_requests_total counter" in text
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL_NAME and card["max_model_len"] == 1024 and card["object"] == "model"


def test_tokenize_and_detokenize(http, demo_model):
    """/detokenize keeps special tokens, as vLLM's does: the BOS the prompt got, the chat template's markers."""
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(demo_model, control_plane=True)
    tokens = http.post(TOK, json={"prompt": "def main():"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 1024
    bos = tokenizer.decode(tokens["tokens"][:1], skip_special_tokens=False)
    assert bos and http.post(DETOK, json={"tokens": tokens["tokens"]}).json()["prompt"] == bos + "def main():"
    bare = http.post(TOK, json={"prompt": "def main():", "add_special_tokens": False}).json()["tokens"]
    assert bare == tokens["tokens"][1:]  # vLLM's add_special_tokens: no BOS
    used = http.post(C, json=completion(add_special_tokens=False, max_tokens=1)).json()["usage"]
    assert used["prompt_tokens"] == len(bare)
    rendered = http.post(TOK, json={"messages": CHAT, "model": MODEL_NAME}).json()
    usage = http.post(CH, json=chat(max_tokens=1)).json()["usage"]
    assert rendered["count"] == usage["prompt_tokens"]
    text = http.post(DETOK, json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(rendered["tokens"], skip_special_tokens=False) != tokenizer.decode(rendered["tokens"])


def test_abort_route_ends_a_running_stream(gateway, http):
    with http.stream("POST", C, json={**LONG, "max_tokens": 400, "stream": True}) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        aborted = http.post(f"/v1/abort/{first['id']}")
        assert aborted.status_code == 200 and aborted.json()["aborted"] == [first["id"] + "-0"]
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"


async def _read_chunks(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> list[dict]:
    """Stream a completion; hang up after `stop_after` chunks."""
    chunks = []
    async with client.stream("POST", C, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if stop_after is not None and len(chunks) >= stop_after:
                    return chunks  # leaving the block closes the connection mid-stream
    return chunks


async def _until_engine(gateway, condition, timeout_s: float = 30.0) -> None:
    """Wait until every engine replica's status satisfies `condition`."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = await engine_statuses(gateway.nats_url, 0.6)
        if statuses and all(condition(status) for status in statuses.values()):
            return
        assert time.monotonic() < deadline, f"engine status never got there: {statuses}"


def test_the_engine_draws_only_allowed_tokens_and_the_answer_names_them(http):
    """vLLM's allowed_token_ids through the whole stack (sampled at temperature 1), and return_token_ids's
    ids equal what the text says; a stream gives the same ids."""
    body = completion(prompt="x", max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                      allowed_token_ids=[40, 41, 42], return_token_ids=True)
    choice = http.post(C, json=body).json()["choices"][0]
    assert len(choice["token_ids"]) == 12 and set(choice["token_ids"]) <= {40, 41, 42}
    assert choice["prompt_token_ids"] == http.post(TOK, json={"prompt": "x"}).json()["tokens"]
    streamed = sse_events(http.post(C, json={**body, "stream": True}).content)[:-1]
    assert [t for c in streamed for t in c["choices"][0].get("token_ids") or []] == choice["token_ids"]


def test_clients_that_go_away_are_aborted_and_free_their_kv(gateway):
    async def go():
        nc = await nats.connect(gateway.nats_url)
        aborted: list[str] = []

        async def on_abort(msg):
            aborted.append(json.loads(msg.data)["id"])
        await nc.subscribe(subjects.ABORT, cb=on_abort)
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=120) as client:
            body = {**LONG, "max_tokens": 60, "stream": True}
            quitter, *stayers = await asyncio.gather(_read_chunks(client, {**body, "max_tokens": 400}, 3),
                                                     _read_chunks(client, body), _read_chunks(client, body))
            await asyncio.sleep(0.5)
            assert quitter[0]["id"] + "-0" in aborted
            for chunks in stayers:  # the other streams went on to the end
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                assert sum(len(c["choices"]) for c in chunks) >= 2

            # Queued: 4 long streams fill the engine (--max-num-seqs 4), a 5th waits and its client goes away.
            # The worker is stopped meanwhile so that no filler can finish first, however fast the engine.
            fillers = [asyncio.create_task(_read_chunks(client, {**body, "max_tokens": 1000}))
                       for _ in range(4)]
            await _until_engine(gateway, lambda s: s.num_running == 4)
            workers = worker_pids(gateway)
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            try:
                before = set(aborted)
                queued = asyncio.create_task(client.post(C, json={**LONG, "max_tokens": 5}))
                deadline = time.monotonic() + 30
                while "orca:admission_queue_len 1" not in (await client.get("/metrics")).text:
                    assert time.monotonic() < deadline, "the 5th request was never queued"
                    await asyncio.sleep(0.05)
                assert not queued.done()
                for task in (queued, *fillers):  # the clients hang up, the queued one while its request waits
                    task.cancel()
                await asyncio.gather(queued, *fillers, return_exceptions=True)
                deadline = time.monotonic() + 10
                while len(set(aborted) - before) < 5:
                    assert time.monotonic() < deadline, "the queued request and the 4 fillers were aborted"
                    await asyncio.sleep(0.05)
            finally:
                for pid in workers:
                    os.kill(pid, signal.SIGCONT)
            await _until_engine(gateway, lambda s: s.num_running == 0 and s.num_waiting == 0)
        await nc.close()
    asyncio.run(go())
    statuses = asyncio.run(engine_statuses(gateway.nats_url))
    for status in statuses.values():
        assert status.kv_used_blocks == 0 and status.num_running == 0 and status.num_waiting == 0
    metrics = httpx.get(gateway.http_url + "/metrics").text
    assert "orca:admission_queue_len 0" in metrics and "orca:num_requests_running 0" in metrics
    # the queued (not streamed) request's client left before any response: nginx's 499, not a server error
    assert 'orca:http_requests_total{route="/v1/completions",code="499"}' in metrics, metrics
    assert 'code="500"' not in metrics, metrics
