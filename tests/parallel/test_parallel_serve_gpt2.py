"""`orca serve -tp 2 -pp 2` with the GPT-2 family (LayerNorm, learned positions, fused c_attn
split by heads, biases added once after the row-parallel all-reduce)."""

from __future__ import annotations

import asyncio

import pytest

from tests.parallel.test_parallel_serve import SPLIT, bodies
from tests.services.stack import OrcaServe
from tests.services.test_pipeline import in_process, produce_concurrently

pytestmark = pytest.mark.slow


def test_split_gpt2_streams_what_the_whole_model_generates(demo_gpt2):
    serve = OrcaServe(["--model", demo_gpt2, "--dtype", "float64", *SPLIT, "--port", "0", "--max-num-seqs", "4",
                       "--kv-cache-tokens", "8192"])
    try:
        requests = bodies("gpt2", 5, 8)
        streamed = asyncio.run(produce_concurrently(serve.nats_url, requests))
    finally:
        assert serve.stop() == 0
    reference = in_process(demo_gpt2, requests, dtype="float64")
    for body in requests:
        tokens = [t for e in streamed[body["id"]] for t in e["token_ids"]]
        assert tokens == reference[body["id"]]["token_ids"], body["id"]
