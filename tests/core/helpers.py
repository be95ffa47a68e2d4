"""Tiny scheduler set-ups and a hand-driven 'model' for step-trace tests."""

from __future__ import annotations

from core.batch import RunnerOutput, SchedulerOutput
from core.kv_cache import KVCacheManager
from core.policies import make_policy
from core.request import Request
from core.scheduler import Scheduler
from shared.sampling import SamplingParams

EOS = 2


def make_scheduler(policy: str = "orca", *, num_blocks: int = 64, block_size: int = 1, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 256, max_model_len: int = 64,
                   enable_chunked_prefill: bool = False, enable_prefix_caching: bool = False,
                   pipeline_depth: int = 1) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(make_policy(policy), kv, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     enable_chunked_prefill=enable_chunked_prefill, pipeline_depth=pipeline_depth)


def make_request(request_id: str, prompt_len: int, max_tokens: int, ignore_eos: bool = True, priority: int = 0,
                 prompt: list[int] | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    tokens = prompt if prompt is not None else list(range(10, 10 + prompt_len))
    return Request(request_id, tokens, params, eos_token_ids=(EOS,), priority=priority)


def fake_step(output: SchedulerOutput, tokens: dict[str, int] | None = None) -> RunnerOutput:
    """Sample token 7 for every request that samples, unless `tokens` says otherwise."""
    tokens = tokens or {}
    sampled = {s.request_id: tokens.get(s.request_id, 7) for s in output.scheduled if s.samples}
    return RunnerOutput(sampled_token_ids=sampled)


def run_to_end(scheduler: Scheduler, max_iterations: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_iterations):
        if not scheduler.has_unfinished:
            return outputs
        out = scheduler.schedule()
        scheduler.update(out, fake_step(out))
        outputs.append(out)
    raise AssertionError("scheduler did not finish")
