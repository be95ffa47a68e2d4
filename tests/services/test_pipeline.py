"""The service pipeline end to end: `orca serve` (real nats-server, real local Ray) and NATS producers."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time

import nats
import pytest

from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tests.services.stack import (OrcaServe, cmdline, descendants, engine_statuses, kill_while_streaming, running,
                                  stream, worker_pids)

pytestmark = pytest.mark.slow

PROMPTS = ["def main():", "import os\n", "class Config:", "for i in range(10):", "# ünïcødé — 日本語",
           "return x", "while True:", "print('hello')"]


@pytest.fixture(scope="module")
def stack(demo_model):
    serve = OrcaServe(["--model", demo_model, "--port", "0", "--replicas", "2", "--max-num-seqs", "4",
                       "--kv-cache-tokens", "16384", "--worker-threads", "1"])
    yield serve
    assert serve.stop() == 0


def requests() -> list[dict]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append({"id": f"text-{i}", "prompt": prompt, "max_tokens": 6 + 3 * i, "temperature": 0})
    out.append({"id": "ids", "prompt_token_ids": [12, 345, 678, 90], "max_tokens": 9, "temperature": 0,
                "logprobs": 3})
    out.append({"id": "seeded", "prompt": "import sys", "max_tokens": 12, "temperature": 0.9, "seed": 11})
    return out


def in_process(demo_model: str, bodies: list[dict], dtype: str = "auto") -> dict[str, dict]:
    """`orca generate`'s results for `bodies`, run here. Its imports (torch) happen here, not when the
    module is collected: `make test`'s end-to-end workers collect every module and need no torch."""
    from engine.batch_job import run_batch
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=demo_model, dtype=dtype),
                                    scheduler=SchedulerConfig(max_num_seqs=3), cache=CacheConfig(kv_cache_tokens=8192)))
    out = io.StringIO()
    run_batch(engine, [json.dumps(b) for b in bodies], out, progress=False)
    return {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}


async def produce_concurrently(url: str, bodies: list[dict]) -> dict[str, list[dict]]:
    async def one(body):
        nc = await nats.connect(url)  # each producer its own connection
        try:
            return body["id"], await stream(nc, body)
        finally:
            await nc.close()
    return dict(await asyncio.gather(*(one(b) for b in bodies)))


def with_stop_string(demo_model: str) -> tuple[dict, str]:
    """A request whose greedy text is known to contain its stop string mid-way."""
    body = {"id": "stop", "prompt": "def f(x):", "max_tokens": 40, "temperature": 0}
    text = in_process(demo_model, [body])["stop"]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    return {**body, "stop": [stop]}, text[:text.index(stop)]


def test_streamed_greedy_output_equals_orca_generate(stack, demo_model):
    stop_body, text_before_stop = with_stop_string(demo_model)
    bodies = requests() + [stop_body]
    streamed = asyncio.run(produce_concurrently(stack.nats_url, bodies))
    expected = in_process(demo_model, bodies)
    for body in bodies:
        events = streamed[body["id"]]
        final = events[-1]
        assert all(e["finish_reason"] is None for e in events[:-1])
        tokens = [t for e in events for t in e["token_ids"]]
        text = "".join(e["text"] for e in events)
        assert tokens == expected[body["id"]]["token_ids"], body["id"]
        assert text == expected[body["id"]]["text"], body["id"]
        assert final["finish_reason"] == expected[body["id"]]["finish_reason"]
        assert final["usage"] == {"prompt_tokens": len(expected[body["id"]]["prompt_token_ids"]),
                                  "completion_tokens": len(tokens)}
        if "logprobs" in body:
            streamed_logprobs = [lp for e in events for lp in e["logprobs"]]
            assert [lp["token_id"] for lp in streamed_logprobs] == tokens
            assert all(len(lp["top_logprobs"]) == 3 for lp in streamed_logprobs)
            assert [lp["logprob"] for lp in streamed_logprobs] == pytest.approx(
                [lp["logprob"] for lp in expected[body["id"]]["logprobs"]], abs=1e-5)
    assert streamed["stop"][-1]["finish_reason"] == "stop"
    assert "".join(e["text"] for e in streamed["stop"]) == text_before_stop


@pytest.mark.parametrize("body,error", [
    (b"not json", "malformed JSON"),
    (b'{"id": "u", "prompt": "hi", "bogus": 1}', "unknown field"),
    (b'{"id": "t", "prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"id": "v", "prompt_token_ids": [1, 999999]}', "outside the vocabulary"),
    (b'{"id": "w", "prompt": ""}', "empty"),
    (json.dumps({"id": "long", "prompt_token_ids": [5] * 1100}).encode(), "context"),
    (b'{"id": "z", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"id": "s", "prompt": "hi", "stop": [""]}', "stop"),
    (b'[1, 2]', "Expected `object`"),
    (b'{"id": "g1", "prompt": "hi", "structured_outputs": {"regex": "a(b"}}', "unclosed group"),
    (b'{"id": "g2", "prompt": "hi", "structured_outputs": {"json": {"type": "objekt"}}}', "objekt"),
    (b'{"id": "g3", "prompt": "hi", "response_format": {"type": "json_schema"}}', "json_schema.schema"),
    (b'{"id": "g4", "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}', "exactly one"),
])
def test_bad_requests_get_a_single_error_event(stack, body, error):
    async def go():
        nc = await nats.connect(stack.nats_url)
        try:
            return await stream(nc, body, timeout_s=30)
        finally:
            await nc.close()
    events = asyncio.run(go())
    assert len(events) == 1 and events[0]["finish_reason"] == "error"
    assert error in events[0]["error"]


def test_abort_while_queued_and_while_running_frees_kv(stack):
    async def go():
        nc = await nats.connect(stack.nats_url)
        first_token = asyncio.Event()

        def seen(event):
            first_token.set()

        bodies = [{"id": f"long-{i}", "prompt": "x = 1", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
                  for i in range(10)]  # 2 replicas x 4 seqs: 8 run, 2 wait in admission
        tasks = [asyncio.create_task(stream(nc, b, on_event=seen if b["id"] == "long-0" else None))
                 for b in bodies]
        await asyncio.wait_for(first_token.wait(), 60)
        await nc.publish("orca.v1.abort", json.dumps({"id": "long-9"}).encode())  # still queued
        await nc.publish("orca.v1.abort", json.dumps({"id": "long-0"}).encode())  # running
        await asyncio.sleep(1)
        for b in bodies[1:9]:
            await nc.publish("orca.v1.abort", json.dumps({"id": b["id"]}).encode())
        results = await asyncio.gather(*tasks)
        await nc.close()
        return results
    results = asyncio.run(go())
    reasons = {r[-1]["id"]: r[-1]["finish_reason"] for r in results}
    assert set(reasons.values()) == {"abort"}
    assert results[9][-1]["usage"]["completion_tokens"] == 0  # aborted before it ever ran
    assert 0 < results[0][-1]["usage"]["completion_tokens"] < 400
    statuses = asyncio.run(engine_statuses(stack.nats_url))
    assert len(statuses) == 2
    for status in statuses.values():
        assert status.kv_used_blocks == 0 and status.num_running == 0 and status.num_waiting == 0


def test_two_replicas_share_the_load(stack):
    bodies = [{"id": f"share-{i}", "prompt": "def main():", "max_tokens": 16, "temperature": 0} for i in range(12)]
    before = asyncio.run(engine_statuses(stack.nats_url))
    asyncio.run(produce_concurrently(stack.nats_url, bodies))
    after = asyncio.run(engine_statuses(stack.nats_url))
    assert set(after) == {"0", "1"}
    assert all(after[r].iteration > before[r].iteration for r in after), "both replicas served"
    assert all(s.kv_used_blocks == 0 for s in after.values())


def test_jetstream_jobs_run_exactly_once_and_results_persist(stack, demo_model):
    bodies = [{"id": f"job-{i}", "prompt": "import os", "max_tokens": 5 + i, "temperature": 0} for i in range(4)]

    async def go():
        nc = await nats.connect(stack.nats_url)
        js = nc.jetstream()
        acks = []
        for body in bodies + bodies:  # every job published twice
            acks.append(await js.publish("orca.v1.jobs.submit", json.dumps(body).encode(),
                                         headers={"Nats-Msg-Id": body["id"]}))
        results = {}
        for _ in range(600):
            for body in bodies:
                if body["id"] in results:
                    continue
                try:
                    msg = await js.get_last_msg("ORCA_JOB_RESULTS", f"orca.v1.jobs.result.{body['id']}")
                    results[body["id"]] = json.loads(msg.data)
                except nats.js.errors.NotFoundError:
                    pass
            if len(results) == len(bodies):
                break
            await asyncio.sleep(0.2)
        info = await js.stream_info("ORCA_JOB_RESULTS")
        await nc.close()
        return acks, results, info
    acks, results, info = asyncio.run(go())
    assert [bool(a.duplicate) for a in acks] == [False] * 4 + [True] * 4
    assert info.state.last_seq == len(bodies), "one stored result per job id, no second generation"
    expected = in_process(demo_model, bodies)
    for body in bodies:
        assert results[body["id"]]["token_ids"] == expected[body["id"]]["token_ids"]
        assert results[body["id"]]["text"] == expected[body["id"]]["text"]
        assert results[body["id"]]["finish_reason"] == "length"


def test_requests_resume_with_the_same_output_after_their_worker_is_killed(stack, demo_model):
    """Last in this module: it kills a worker process. The engine master keeps the requests; once
    Ray has restarted the worker they resume by recompute and finish as if nothing happened."""
    workers = worker_pids(stack)
    assert len(workers) == 2
    preemptions_before = sum(s.num_preemptions for s in asyncio.run(engine_statuses(stack.nats_url)).values())
    bodies = [{"id": f"victim-{i}", "prompt": f"x = {i}", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
              for i in range(6)]

    results = asyncio.run(kill_while_streaming(stack.nats_url, bodies, workers[0], started_within_s=60))
    expected = in_process(demo_model, bodies)
    for body, events in zip(bodies, results):
        assert events[-1]["finish_reason"] == "length", events[-1]
        assert [t for e in events for t in e["token_ids"]] == expected[body["id"]]["token_ids"]
    assert workers[0] not in worker_pids(stack) and len(worker_pids(stack)) == 2  # Ray restarted it
    bodies = [{"id": f"after-{i}", "prompt": "def main():", "max_tokens": 8, "temperature": 0} for i in range(6)]
    after = asyncio.run(produce_concurrently(stack.nats_url, bodies))
    assert all(events[-1]["finish_reason"] == "length" for events in after.values())
    statuses = asyncio.run(engine_statuses(stack.nats_url))
    assert all(s.ready and s.kv_used_blocks == 0 for s in statuses.values())
    assert sum(s.num_preemptions for s in statuses.values()) > preemptions_before, "nothing was resumed"


def test_structured_outputs_over_nats_match_their_constraints(stack):
    """Through the tokenizer, admission, the engine master and its Ray worker: JSON schema (OpenAI's
    response_format and vLLM's structured_outputs), regex and choice, greedy and seeded, side by side."""
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                                               "name": {"type": "string", "maxLength": 8}},
              "required": ["id", "tags", "name"]}
    bodies = []
    for i in range(12):
        body = {"id": f"so-{i}", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 80,
                "temperature": 0 if i % 2 else 1.0, "seed": i}
        kind = i % 3
        if kind == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}
        elif kind == 1:
            body["structured_outputs"] = {"regex": "[a-z]{3}-[0-9]{2,4}"}
        else:
            body["structured_outputs"] = {"choice": ["alpha", "beta", "gamma"]}
        bodies.append(body)
    results = asyncio.run(produce_concurrently(stack.nats_url, bodies))
    for i, body in enumerate(bodies):
        final = results[body["id"]][-1]
        assert final["finish_reason"] == "stop", final
        text = "".join(e["text"] for e in results[body["id"]])
        if i % 3 == 0:
            jsonschema.validate(json.loads(text), schema)
        elif i % 3 == 1:
            assert re.fullmatch("[a-z]{3}-[0-9]{2,4}", text), text
        else:
            assert text in ("alpha", "beta", "gamma")


def test_a_sigterm_to_its_whole_process_group_stops_everything_in_seconds(stack):
    """Last in the module: it stops the stack. `kill -- -PGID`, and systemd stopping a unit (its default
    KillMode signals the whole cgroup), SIGTERM Ray's head processes along with `orca serve`: the stop
    then blocked on the dead GCS until Ray's 60 s timeout killed it (exit 1), the jobs service spun in
    its interpreter's final garbage collection until it was killed, and a stream in flight, which no
    engine could finish any more, waited out the whole --drain-timeout for its error."""
    started = [pid for pid, _ in descendants(stack.process.pid)]
    assert len(started) >= 8  # nats-server, three services, Ray's head, the engines' and Serve's actors

    async def stream_through_the_stop() -> tuple[dict, float]:
        nc = await nats.connect(stack.nats_url)
        first = asyncio.Event()
        body = {"id": "through-the-stop", "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        streaming = asyncio.create_task(stream(nc, body, timeout_s=60, on_event=lambda event: first.set()))
        await asyncio.wait_for(first.wait(), 30)
        began = time.monotonic()
        os.killpg(stack.process.pid, signal.SIGTERM)
        events = await streaming
        await nc.close()
        return events[-1], time.monotonic() - began

    final, ended_after = asyncio.run(stream_through_the_stop())
    assert final["finish_reason"] == "error" and "shutting down" in final["error"], final
    assert ended_after < 10, f"the stream ended {ended_after:.1f} s after the signal"
    assert stack.process.wait(timeout=60) == 0
    assert any("skipping what died with it" in line for line in stack.log), "".join(stack.log[-30:])
    deadline = time.monotonic() + 5
    while (left := [pid for pid in started if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [cmdline(pid) for pid in left]

