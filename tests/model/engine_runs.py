"""Runs of the in-process engine and of transformers on the same prompts, for the token-for-token tests."""

from __future__ import annotations

import contextlib
import random

import torch

from engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams


def workload(seed: int = 0, n: int = 6, shared_prefix: bool = False) -> list[tuple[list[int], int]]:
    """Prompts of different lengths; with `shared_prefix`, all start with the same 20 tokens
    (a system prompt), so prefix reuse has something to share."""
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(20)] if shared_prefix else []
    return [(system + [rng.randrange(512) for _ in range(rng.randint(1, 40))], rng.randint(1, 12))
            for _ in range(n)]


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
             chunked=False, logprobs=None, kv_cache_tokens=4096, prefix=False, enforce_eager=None) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=24 if chunked else None, enable_chunked_prefill=chunked),
        cache=CacheConfig(kv_cache_tokens=kv_cache_tokens, block_size=block_size, enable_prefix_caching=prefix),
    )
    engine = LLMEngine(config)
    # A compiled step compiles every graph it needs while it warms up (both torch thread counts the CPU
    # runner switches between, one-token and longer batches): a compile while serving stalls every request.
    with torch._dynamo.config.patch(error_on_recompile=enforce_eager is False):
        done = run_to_completion(engine, prompts, logprobs, prefix)
    assert engine.kv_cache.num_used_blocks == 0
    done["preemptions"] = engine.scheduler.num_preemptions
    done["prefix_hits"] = engine.kv_cache.prefix_hits
    return done


@contextlib.contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_to_completion(engine, prompts, logprobs, prefix) -> dict:
    done = {}
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                          logprobs=logprobs))
        if prefix and i == 0:  # the first computes the shared prefix; the others arrive after it
            for delta in engine.step() + engine.step():
                if delta.finished:
                    done[int(delta.completion.request_id)] = delta.completion
    while engine.has_unfinished:
        for delta in engine.step():
            if delta.finished:
                done[int(delta.completion.request_id)] = delta.completion
    return done
