"""`"max_tokens": null` means "until the context is full", as in vLLM's offline API, in each way in that takes
the request body as it is (`orca generate` and NATS; the HTTP API resolves its own default): the request runs
to the context and ends with `length`; the engine reserves (and the telemetry reports) no number for it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine.batch_job import run_batch
from engine.llm_engine import LLMEngine
from shared.codec import Codec
from shared.config import EngineConfig, ModelConfig
from shared.messages import TokenizedRequest


def test_orca_generate_runs_a_null_max_tokens_to_the_context(demo_model):
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=demo_model, max_model_len=24)))
    records = []

    class Sink:
        def write(self, line: str) -> None:
            records.extend(json.loads(x) for x in line.splitlines() if x)

    body = {"prompt_token_ids": list(range(5, 15)), "ignore_eos": True, "temperature": 0}
    run_batch(engine, [json.dumps({"id": "null", **body, "max_tokens": None}),
                       json.dumps({"id": "zero", **body, "max_tokens": 0})], Sink(), progress=False)
    null, zero = records
    assert (len(null["token_ids"]), null["finish_reason"]) == (24 - 10, "length")
    assert zero["finish_reason"] == "error" and "max_tokens=0 must be an integer >= 1" in zero["error"]


def test_the_tokenizer_service_submits_a_null_max_tokens_as_none():
    from services.tokenizer.service import TokenizerService
    from shared import subjects
    from tests.fake_nats import RecordingNats
    from tests.reliability.test_recovery_shells import FakeTokenizer

    async def go():
        nc = RecordingNats()
        service = TokenizerService(nc, FakeTokenizer(), vocab_size=100, instance="tok")
        body = json.dumps({"id": "r", "prompt_token_ids": [1, 2], "max_tokens": None})
        await service.on_generate(SimpleNamespace(data=body.encode(), reply="client.r", headers=None))
        return nc.on(subjects.ADMISSION_SUBMIT), nc.on("client.r")

    submitted, refused = asyncio.run(go())
    assert not refused
    assert Codec(TokenizedRequest).decode(submitted[0]).params.max_tokens is None
