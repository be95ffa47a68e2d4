"""The model runner against Hugging Face transformers, token for token.

float64: greedy tokens equal transformers' greedy `generate` for every request, whatever
the batch composition (max_num_seqs 1 vs 16, both schedulers, chunked prefill, different
prompt lengths arriving together). float32: each step's logprobs agree closely.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.model.checkpoints import make_checkpoint

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    return arch, make_checkpoint(arch, tmp_path_factory.mktemp(arch), sharded=arch == "llama")


@pytest.fixture(scope="module")
def hf_expected(checkpoint):
    return hf_greedy(checkpoint[1], workload(), torch.float64)


def workload(seed: int = 0, n: int = 6) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(512) for _ in range(rng.randint(1, 40))], rng.randint(1, 12)) for _ in range(n)]


def hf_greedy(model_dir, prompts, dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outputs = []
    for prompt, max_tokens in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def orca_run(model_dir, prompts, *, dtype="float64", policy="orca", max_num_seqs=16, block_size=16,
             chunked=False, logprobs=None) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=24 if chunked else None, enable_chunked_prefill=chunked),
        cache=CacheConfig(kv_cache_tokens=4096, block_size=block_size),
    )
    engine = LLMEngine(config)
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                          logprobs=logprobs))
    done = {}
    while engine.has_unfinished:
        for delta in engine.step():
            if delta.finished:
                done[int(delta.completion.request_id)] = delta.completion
    assert engine.kv_cache.num_used_blocks == 0
    return done


@pytest.mark.parametrize("policy,max_num_seqs,block_size,chunked", [
    ("orca", 16, 16, False), ("orca", 1, 16, False), ("request-level", 16, 1, False),
    ("request-level", 3, 4, False), ("orca", 16, 4, True),
])
def test_greedy_tokens_equal_transformers_float64(checkpoint, hf_expected, policy, max_num_seqs, block_size,
                                                  chunked):
    arch, model_dir = checkpoint
    prompts = workload()
    expected = hf_expected
    done = orca_run(model_dir, prompts, policy=policy, max_num_seqs=max_num_seqs, block_size=block_size,
                    chunked=chunked)
    got = [done[i].token_ids for i in range(len(prompts))]
    assert got == expected


def test_logprobs_agree_with_transformers_float32(checkpoint):
    from transformers import AutoModelForCausalLM

    arch, model_dir = checkpoint
    prompts = workload(seed=1, n=4)
    done = orca_run(model_dir, prompts, dtype="float32", logprobs=5)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (prompt, _) in enumerate(prompts):
        tokens = done[i].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        expected = torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        for step, lp in enumerate(done[i].logprobs):
            assert lp.logprob == pytest.approx(expected[step, lp.token_id].item(), abs=2e-4)
            for token_id, value in lp.top:
                assert value == pytest.approx(expected[step, token_id].item(), abs=2e-4)
