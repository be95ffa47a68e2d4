"""The gateway through the real `openai` client (sync and async, streaming and not), checked
against `orca generate`'s greedy output for the same requests."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.gateway.conftest import MODEL_NAME
from tests.services.test_pipeline import in_process

pytestmark = pytest.mark.slow

PROMPTS = ["def main():", "import os\n", "# ünïcødé — 日本語", "class Config:"]
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "print hello"}]


@pytest.fixture(scope="module")
def expected(demo_model) -> dict[str, dict]:
    """`orca generate` (in process, no NATS, no Ray) for the same greedy requests."""
    bodies = [{"id": f"p{i}", "prompt": p, "max_tokens": 10, "temperature": 0} for i, p in enumerate(PROMPTS)]
    bodies.append({"id": "chat", "messages": CHAT, "max_tokens": 12, "temperature": 0})
    bodies.append({"id": "ids", "prompt_token_ids": [12, 345, 678, 90], "max_tokens": 7, "temperature": 0})
    return in_process(demo_model, bodies)


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion(client, expected):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL_NAME
    assert [c.index for c in out.choices] == [0]
    assert out.choices[0].text == expected["p0"]["text"]
    assert out.choices[0].finish_reason == expected["p0"]["finish_reason"]
    assert out.usage.prompt_tokens == len(expected["p0"]["prompt_token_ids"])
    assert out.usage.completion_tokens == len(expected["p0"]["token_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_of_several_prompts_and_token_ids(client, expected):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.text for c in out.choices] == [expected[f"p{i}"]["text"] for i in range(len(PROMPTS))]
    assert out.usage.prompt_tokens == sum(len(expected[f"p{i}"]["prompt_token_ids"]) for i in range(len(PROMPTS)))
    ids = client.completions.create(model=MODEL_NAME, prompt=[12, 345, 678, 90], max_tokens=7, temperature=0)
    assert ids.choices[0].text == expected["ids"]["text"]


def test_completion_stream(client, expected):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["p2"]["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected["p2"]["finish_reason"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected["p2"]["token_ids"])
    assert all(c.usage is None for c in chunks[:-1])


def test_chat(client, expected):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected["chat"]["text"]
    assert out.usage.prompt_tokens == len(expected["chat"]["prompt_token_ids"])


def test_chat_stream_with_usage(client, expected):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["chat"]["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["chat"]["token_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [expected["chat"]["finish_reason"]]


def test_n_choices_with_seed_are_reproducible(client):
    def texts(**kw):
        out = client.completions.create(model=MODEL_NAME, prompt="x =", max_tokens=6, temperature=1.0, **kw)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    three = texts(n=3, seed=7)
    assert len(three) == 3 and three == texts(n=3, seed=7)
    assert three[1] == texts(seed=8)[0] and three[2] == texts(seed=9)[0], "choice i is seeded seed + i"


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_errors_come_as_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=5000)
    assert "1024" in info.value.message and "5000" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)


def test_async_client_concurrently(gateway, expected):
    async def go():
        client = openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def completion(i):
            return (await client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i], max_tokens=10,
                                                    temperature=0)).choices[0].text

        async def streamed(i):
            stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i], max_tokens=10,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def chat():
            return (await client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12,
                                                         temperature=0)).choices[0].message.content

        async def chat_streamed():
            stream = await client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12,
                                                          temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        try:
            return await asyncio.gather(*[completion(i) for i in range(4)], *[streamed(i) for i in range(4)],
                                        chat(), chat_streamed())
        finally:
            await client.close()
    texts = asyncio.run(go())
    reference = [expected[f"p{i}"]["text"] for i in range(4)]
    assert texts == reference + reference + [expected["chat"]["text"]] * 2


def test_logprobs_reach_the_client(client, expected):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 10 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)


def test_an_echoed_prompt_is_scored_as_transformers_scores_it(client, demo_model):
    """lm-eval-harness's loglikelihood request (echo, logprobs 1, max_tokens 1, temperature 0): the prompt's
    tokens with their logprobs (the first null) and the top one, as transformers gives them; then with
    max_tokens 0, the prompt alone and the same figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import load_tokenizer

    ids = load_tokenizer(demo_model).encode("The quick brown fox jumps over the lazy dog")
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    scored = []
    for max_tokens in (1, 0):
        out = client.completions.create(model=MODEL_NAME, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert out.usage.completion_tokens == max_tokens
        for position in range(1, len(ids)):
            assert lp.token_logprobs[position] == pytest.approx(expected[position - 1, ids[position]].item(), abs=2e-4)
            best = int(expected[position - 1].argmax())
            assert max(lp.top_logprobs[position].values()) == pytest.approx(expected[position - 1, best].item(),
                                                                             abs=2e-4)
        scored.append(lp.token_logprobs[:len(ids)])
    assert scored[0] == pytest.approx(scored[1], abs=1e-6)


@pytest.mark.parametrize("example", ["openai_client.py", "structured_outputs.py"])
def test_the_readme_examples_run_against_the_gateway(gateway, example):
    """Each checks its own results (a schema, a regex, a tool call): the README calls them runnable."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "examples" / example), "--base-url", gateway.http_url + "/v1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
