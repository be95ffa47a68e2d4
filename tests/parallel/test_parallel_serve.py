"""`orca serve -tp 2 -pp 2`: four worker actors in a Ray placement group, a gloo group between
them, steps and results over NATS. Output equals the unsplit model's; the engine keeps two
batches in flight; a killed worker costs no request. The Llama family only: a Ray worker actor builds
its shard with the same runner as `orca generate`'s worker processes, whose splits of every family
(GPT-2's fused c_attn and biases included) test_parallel_engine.py compares with the whole model."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.services.stack import OrcaServe, engine_statuses, kill_while_streaming, worker_pids
from tests.services.test_pipeline import in_process, produce_concurrently

pytestmark = pytest.mark.slow

SPLIT = ["-tp", "2", "-pp", "2", "--worker-cpus", "0.25", "--worker-threads", "1"]


@pytest.fixture(scope="module")
def parallel_stack(demo_model):
    serve = OrcaServe(["--model", demo_model, "--dtype", "float64", *SPLIT, "--port", "0", "--max-num-seqs", "4",
                       "--kv-cache-tokens", "8192"])
    yield serve
    assert serve.stop() == 0


def bodies(prefix: str, n: int, max_tokens: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "prompt": f"def f{i}(x):", "max_tokens": max_tokens + i, "temperature": 0,
             "ignore_eos": True} for i in range(n)]


def test_split_engine_streams_what_the_whole_model_generates(parallel_stack, demo_model):
    requests = bodies("split", 6, 10)
    streamed = asyncio.run(produce_concurrently(parallel_stack.nats_url, requests))
    reference = in_process(demo_model, requests, dtype="float64")
    for body in requests:
        events = streamed[body["id"]]
        assert events[-1]["finish_reason"] == "length"
        assert [t for e in events for t in e["token_ids"]] == reference[body["id"]]["token_ids"], body["id"]
    (status,) = asyncio.run(engine_statuses(parallel_stack.nats_url)).values()
    assert status.pipeline_depth == 2
    assert status.max_batches_in_flight == 2, "the engine never had two batches in flight"
    assert status.kv_used_blocks == 0


def test_a_killed_worker_costs_no_request_and_the_engine_serves_again(parallel_stack, demo_model):
    """Last in this module. Killing one of the four workers breaks the gloo group: the master
    restarts all four (a new group), and the requests resume by recompute."""
    workers = worker_pids(parallel_stack)
    assert len(workers) == 4
    requests = bodies("victim", 4, 60)

    results = asyncio.run(kill_while_streaming(parallel_stack.nats_url, requests, workers[2], started_within_s=120,
                                               timeout_s=300))
    reference = in_process(demo_model, requests, dtype="float64")
    for body, events in zip(requests, results):
        final = events[-1]
        assert final["finish_reason"] in ("length", "error"), final
        if final["finish_reason"] == "length":
            assert [t for e in events for t in e["token_ids"]] == reference[body["id"]]["token_ids"]
    assert any(events[-1]["finish_reason"] == "length" for events in results), "nothing resumed"
    after_pids = worker_pids(parallel_stack)
    assert len(after_pids) == 4 and workers[2] not in after_pids
    after = asyncio.run(produce_concurrently(parallel_stack.nats_url, bodies("after", 4, 6)))
    assert all(events[-1]["finish_reason"] == "length" for events in after.values())
    (status,) = asyncio.run(engine_statuses(parallel_stack.nats_url)).values()
    assert status.ready and status.kv_used_blocks == 0 and status.num_preemptions > 0


def test_a_split_the_cluster_cannot_place_fails_fast_and_says_what_is_missing(demo_model):
    """Checked against this machine's CPUs before a local Ray starts (and against a cluster's right after
    connecting), so before the tokenizer, admission and jobs services: nothing of theirs is started for
    a split that can never run."""
    cpus = os.cpu_count() or 1
    with pytest.raises(RuntimeError) as failure:
        OrcaServe(["--model", demo_model, "-tp", "2", "-pp", "2", "--worker-cpus", str(cpus), "--port", "0"],
                  timeout_s=120)
    log = str(failure.value)
    assert "orca: error: 1 engine replica(s) of tp=2 pp=2 needs 4 worker(s)" in log and "missing" in log, log
    assert "a local Ray on this machine has" in log, "checked only after Ray started"
    assert "ready on nats://" not in log, "the services started before the check"
