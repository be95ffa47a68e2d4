"""The static policy in the real engine: the same greedy tokens as transformers (float64), while
the runner really computes the lockstep prompt tokens and the dead lanes."""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.model.engine_runs import hf_greedy, orca_run, workload


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("max_num_seqs,block_size", [(8, 16), (3, 1)])
def test_static_greedy_tokens_equal_transformers_float64(llama, max_num_seqs, block_size):
    prompts = workload(n=6)
    done = orca_run(llama, prompts, policy="static", max_num_seqs=max_num_seqs, block_size=block_size)
    assert [done[i].token_ids for i in range(len(prompts))] == hf_greedy(llama, prompts, torch.float64)


def test_the_engine_runs_dead_lanes_and_the_batch_to_its_longest_lane(llama):
    from engine.llm_engine import LLMEngine
    from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from shared.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(llama), dtype="float64"),
                                    scheduler=SchedulerConfig(policy="static", max_num_seqs=4),
                                    cache=CacheConfig(kv_cache_tokens=4096)))
    engine.record_iterations = True
    lengths = [(5, 2), (9, 6), (3, 1)]  # (prompt, max_tokens)
    for i, (prompt_len, max_tokens) in enumerate(lengths):
        engine.add_request(str(i), list(range(20, 20 + prompt_len)),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finished_at = {}
    while engine.has_unfinished:
        for delta in engine.step():
            finished_at[delta.completion.request_id] = len(engine.iterations)
    assert len(engine.iterations) == max(p + m for p, m in lengths) - min(p for p, _ in lengths)  # 15 - 3
    assert set(finished_at.values()) == {len(engine.iterations)}  # all return with the batch
    dead = sum(len(it.dead_request_ids) for it in engine.iterations)
    assert dead == sum(len(engine.iterations) - (p - 3 + m) for p, m in lengths)  # lanes idle after their end
    assert all(len(it.scheduled) == 3 for it in engine.iterations)  # every lane, every iteration
    assert engine.kv_cache.num_used_blocks == 0
