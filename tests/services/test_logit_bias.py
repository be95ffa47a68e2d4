"""logit_bias through each way in: `orca generate` (the in-process engine), a NATS producer (the tokenizer
service checks it against the vocabulary before any engine sees it) and the gateway (tests/gateway). On the
demo model: the greedy tokens with a forced token are that token, with the greedy token banned another."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine.batch_job import run_batch
from engine.llm_engine import LLMEngine
from shared.config import EngineConfig, ModelConfig


def generated(engine: LLMEngine, *bodies: dict) -> list[dict]:
    out = []

    class Sink:
        def write(self, line: str) -> None:
            out.extend(json.loads(x) for x in line.splitlines() if x)

    run_batch(engine, [json.dumps(b) for b in bodies], Sink(), progress=False)
    return out


def test_orca_generate_forces_and_bans_tokens_and_names_a_bias_outside_the_vocabulary(demo_model):
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=demo_model)))
    body = {"prompt": "def main():", "max_tokens": 4, "temperature": 0}
    plain, forced, outside = generated(
        engine, {"id": "plain", **body}, {"id": "forced", **body, "logit_bias": {"42": 100}},
        {"id": "outside", **body, "logit_bias": {"999999": 1}})
    assert forced["token_ids"] == [42] * 4 and plain["token_ids"] != forced["token_ids"]
    first = plain["token_ids"][0]
    banned = generated(engine, {"id": "banned", **body, "logit_bias": {str(first): -100}})[0]
    assert banned["token_ids"][0] != first
    assert outside["finish_reason"] == "error"
    assert "logit_bias token id 999999 is outside the vocabulary" in outside["error"]


def test_the_tokenizer_service_refuses_a_bias_outside_the_vocabulary_before_submitting():
    from services.tokenizer.service import TokenizerService
    from shared import subjects
    from tests.fake_nats import RecordingNats
    from tests.reliability.test_recovery_shells import FakeTokenizer

    async def go():
        nc = RecordingNats()
        service = TokenizerService(nc, FakeTokenizer(), vocab_size=100, instance="tok")
        for rid, bias in (("outside", {"100": 1.0}), ("inside", {"99": 1.0})):
            body = json.dumps({"id": rid, "prompt_token_ids": [1, 2], "max_tokens": 2, "logit_bias": bias})
            await service.on_generate(SimpleNamespace(data=body.encode(), reply=f"client.{rid}", headers=None))
        return [json.loads(d) for d in nc.on("client.outside")], len(nc.on(subjects.ADMISSION_SUBMIT))

    refused, submitted = asyncio.run(go())
    assert refused[0]["finish_reason"] == "error" and "outside the vocabulary [0, 100)" in refused[0]["error"]
    assert submitted == 1, "only the request inside the vocabulary went on"


def test_a_stop_token_id_outside_the_vocabulary_is_refused_before_it_reaches_an_engine():
    """With min_tokens the sampler bans the stop token ids by index: one past the vocabulary failed the whole
    engine step, every request on it. The tokenizer service refuses the request alone."""
    from services.tokenizer.service import TokenizerService
    from shared import subjects
    from tests.fake_nats import RecordingNats
    from tests.reliability.test_recovery_shells import FakeTokenizer

    async def go():
        nc = RecordingNats()
        service = TokenizerService(nc, FakeTokenizer(), vocab_size=100, instance="tok")
        body = json.dumps({"id": "r", "prompt_token_ids": [1, 2], "min_tokens": 1, "stop_token_ids": [100]})
        await service.on_generate(SimpleNamespace(data=body.encode(), reply="client.r", headers=None))
        return [json.loads(d) for d in nc.on("client.r")], len(nc.on(subjects.ADMISSION_SUBMIT))

    refused, submitted = asyncio.run(go())
    assert "stop_token_ids token id 100 is outside the vocabulary [0, 100)" in refused[0]["error"]
    assert submitted == 0
