"""The model runner against Hugging Face transformers, token for token.

float64: greedy tokens equal transformers' greedy `generate` for every request, whatever
the batch composition (max_num_seqs 1 vs 16, both schedulers, chunked prefill, different
prompt lengths arriving together). float32: each step's logprobs agree closely.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.model.checkpoints import ARCHS, make_checkpoint
from tests.model.engine_runs import hf_greedy, orca_run, workload


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    return arch, make_checkpoint(arch, tmp_path_factory.mktemp(arch), sharded=arch == "llama")


@pytest.fixture(scope="module")
def hf_expected(checkpoint):
    return {shared: hf_greedy(checkpoint[1], workload(shared_prefix=shared), torch.float64)
            for shared in (False, True)}


@pytest.mark.parametrize("policy,max_num_seqs,block_size,chunked,kv_tokens,prefix", [
    ("orca", 16, 16, False, 4096, False), ("orca", 1, 16, False, 4096, False),
    ("request-level", 16, 1, False, 4096, False), ("request-level", 3, 4, False, 4096, False),
    ("orca", 16, 4, True, 4096, False),
    ("paged", 16, 4, False, 64, False),  # a KV cache this small forces preemptions
    ("paged", 16, 4, True, 4096, True), ("orca", 16, 4, False, 4096, True), ("paged", 16, 4, True, 80, True),
])
def test_greedy_tokens_equal_transformers_float64(checkpoint, hf_expected, policy, max_num_seqs, block_size,
                                                  chunked, kv_tokens, prefix):
    arch, model_dir = checkpoint
    prompts = workload(shared_prefix=prefix)
    done = orca_run(model_dir, prompts, policy=policy, max_num_seqs=max_num_seqs, block_size=block_size,
                    chunked=chunked, kv_cache_tokens=kv_tokens, prefix=prefix)
    got = [done[i].token_ids for i in range(len(prompts))]
    assert got == hf_expected[prefix]
    if kv_tokens < 100:
        assert done["preemptions"] > 0, "the test meant to force preemption"
    if prefix:
        assert done["prefix_hits"] > 0, "the shared prefix was not reused"


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


@pytest.mark.parametrize("policy,chunked,prefix", [("orca", False, False), ("paged", True, True),
                                                   ("static", False, False)])
def test_prompt_logprobs_agree_with_transformers_float32(checkpoint, policy, chunked, prefix):
    """vLLM's prompt_logprobs: for every prompt token after the first, its logprob given the tokens before it
    and the top 3 there, as transformers scores the prompt; also when the prompt is computed in chunks
    (24-token iterations), beside requests that reuse a cached prefix (these never do: every position is
    needed), and in lockstep batches. A request that asks for none gets none."""
    from transformers import AutoModelForCausalLM

    if policy != "orca" and checkpoint[0] != "llama":
        pytest.skip("one architecture covers the other schedules")
    arch, model_dir = checkpoint
    prompts = workload(seed=3, n=5, shared_prefix=prefix)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=4, max_num_batched_tokens=24 if chunked else None,
                                  enable_chunked_prefill=chunked),
        cache=CacheConfig(kv_cache_tokens=4096, block_size=4, enable_prefix_caching=prefix)))
    done = {}

    def run() -> None:
        while engine.has_unfinished:
            done.update({d.completion.request_id: d.completion for d in engine.step() if d.finished})

    for i, (prompt, max_tokens) in enumerate(prompts):
        wanted = None if i == 1 else 3
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                          prompt_logprobs=wanted))
        if prefix and i == 1:  # the one without prompt logprobs caches the shared prefix for those after it
            run()
    run()
    assert done["1"].prompt_logprobs is None
    if prefix:
        assert engine.kv_cache.prefix_hits == 0, "a request that wants prompt logprobs computed its whole prompt"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (prompt, _) in enumerate(prompts):
        if i == 1:
            continue
        got = done[str(i)].prompt_logprobs
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        assert [lp.token_id for lp in got] == prompt[1:]
        for position, lp in enumerate(got):
            assert lp.logprob == pytest.approx(expected[position, prompt[position + 1]].item(), abs=2e-4)
            top = torch.topk(expected[position], 3)
            assert [t for t, _ in lp.top] == top.indices.tolist(), (i, position)
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=2e-4)
