"""long_prefill_token_threshold (vLLM's knob): with chunked prefill, one request's prompt chunk in one
iteration is at most that many tokens, so a long prompt leaves budget to the requests beside it."""

from __future__ import annotations

import pytest

from core.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.outputs import FinishReason
from tests.core.helpers import fake_step, make_request, make_scheduler


def scheduled_tokens(output) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in output.scheduled}


def prefill_chunks(scheduler: Scheduler) -> list[int]:
    """The chunks of the one request queued, up to the one that samples its first token."""
    chunks = []
    while True:
        out = scheduler.schedule()
        (item,) = out.scheduled
        chunks.append(item.num_new_tokens)
        scheduler.update(out, fake_step(out))
        if item.samples:
            return chunks


def decoding_beside(scheduler: Scheduler, *prompts: tuple[str, int]) -> dict[str, int]:
    """Request `a` prefills and starts decoding; then `prompts` arrive: the iteration that follows."""
    scheduler.add_request(make_request("a", 2, 10))
    out = scheduler.schedule()
    scheduler.update(out, fake_step(out))
    for request_id, prompt_len in prompts:
        scheduler.add_request(make_request(request_id, prompt_len, 2))
    return scheduled_tokens(scheduler.schedule())


def test_no_chunk_is_above_the_threshold_and_the_last_is_the_rest():
    s = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=True, long_prefill_token_threshold=8)
    s.add_request(make_request("a", 20, 2))
    assert prefill_chunks(s) == [8, 8, 4]


def test_zero_means_no_cap():
    capped = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=True, long_prefill_token_threshold=0)
    default = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=True)
    for s in (capped, default):
        s.add_request(make_request("a", 40, 2))
    assert prefill_chunks(capped) == prefill_chunks(default) == [16, 16, 8]
    assert SchedulerConfig().long_prefill_token_threshold == 0


def test_a_long_prompt_leaves_budget_to_the_decodes_and_short_prompts_beside_it():
    uncapped = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=True)
    capped = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=True, long_prefill_token_threshold=8)
    assert decoding_beside(uncapped, ("long", 40), ("short", 4)) == {"a": 1, "long": 15}  # short waits
    assert decoding_beside(capped, ("long", 40), ("short", 4)) == {"a": 1, "long": 8, "short": 4}


def test_a_chunk_never_exceeds_the_remaining_budget():
    s = make_scheduler(num_blocks=128, max_num_batched_tokens=16, enable_chunked_prefill=True,
                       long_prefill_token_threshold=12)
    assert decoding_beside(s, ("b", 40), ("c", 40)) == {"a": 1, "b": 12, "c": 3}


@pytest.mark.parametrize("policy", ["orca", "request-level", "paged"])
def test_a_prompt_still_completes_one_token_at_a_time(policy):
    s = make_scheduler(policy, max_num_batched_tokens=16, enable_chunked_prefill=True, long_prefill_token_threshold=1)
    s.add_request(make_request("a", 10, 3))
    tokens, reasons, iterations = [], [], 0
    while s.has_unfinished:
        out = s.schedule()
        assert all(item.num_new_tokens == 1 for item in out.scheduled)
        for event in s.update(out, fake_step(out)):
            tokens.extend(event.new_token_ids)
            reasons.append(event.finish_reason)
        iterations += 1
    assert tokens == [7, 7, 7] and reasons[-1] is FinishReason.LENGTH
    assert iterations == 10 + 2  # ten one-token chunks (the last samples), then two decodes
    assert s.kv_cache.num_used_blocks == 0


def test_without_chunked_prefill_the_threshold_is_ignored():
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, long_prefill_token_threshold=8)
    s.add_request(make_request("a", 40, 2))
    assert scheduled_tokens(s.schedule()) == {"a": 40}


def test_a_static_batch_has_no_chunks_to_cap():
    s = make_scheduler("static", enable_chunked_prefill=True, long_prefill_token_threshold=2)
    s.add_request(make_request("a", 5, 2))
    assert scheduled_tokens(s.schedule()) == {"a": 5}


def test_from_config_carries_the_threshold():
    config = SchedulerConfig(enable_chunked_prefill=True, long_prefill_token_threshold=8)
    s = Scheduler.from_config(config, CacheConfig(kv_cache_tokens=256, block_size=1), max_model_len=64)
    s.add_request(make_request("a", 20, 2))
    assert prefill_chunks(s) == [8, 8, 4]


def test_a_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1"):
        make_scheduler(enable_chunked_prefill=True, long_prefill_token_threshold=-1)
