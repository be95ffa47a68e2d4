"""Property tests: whatever the workload, the scheduler keeps its promises."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.helpers import abort_due, add_arrivals, make_scheduler, sample_eos_at, workload_requests

request_st = workload_requests(last_arrival=6, max_prompt_len=20, max_tokens=12, last_abort=30)
config_st = st.fixed_dictionaries({
    "policy": st.sampled_from(["orca", "request-level"]),
    "block_size": st.sampled_from([1, 4]),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.sampled_from([32, 48, 200]),
    "enable_chunked_prefill": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 1, 3, 8, 25]),  # 0: no cap; 25: above most prompts
})


def assert_chunks_capped(out, chunked: bool, threshold: int, budget: int) -> None:
    """No prefill chunk above the threshold (with chunked prefill; 0: no cap), none above the budget."""
    assert out.num_tokens <= budget
    if chunked and threshold:
        assert all(item.num_new_tokens <= threshold for item in out.scheduled), "a prefill chunk above the threshold"


@settings(max_examples=300, deadline=None)
@given(config=config_st, requests=st.lists(request_st, min_size=1, max_size=12), num_blocks=st.integers(10, 40))
def test_scheduler_invariants(config, requests, num_blocks):
    block_size = config["block_size"]
    s = make_scheduler(config["policy"], num_blocks=num_blocks * 4 // block_size, block_size=block_size,
                       max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["max_num_batched_tokens"],
                       max_model_len=32, enable_chunked_prefill=config["enable_chunked_prefill"],
                       long_prefill_token_threshold=config["long_prefill_token_threshold"])
    accepted: dict[str, int | None] = {}  # in arrival order
    finished: dict[str, object] = {}
    admitted: list[str] = []
    for iteration in range(2000):  # ends once every request has (12 that fill the context, one at a time)
        accepted |= add_arrivals(s, requests, iteration)
        for event in abort_due(s, requests, iteration, live=accepted.keys() - finished.keys()):
            finished[event.request_id] = event.finish_reason
        running_before = {r.request_id for r in s.running}
        out = s.schedule()
        assert_chunks_capped(out, config["enable_chunked_prefill"], config["long_prefill_token_threshold"],
                             config["max_num_batched_tokens"])
        newly = [r.request_id for r in s.running if r.request_id not in running_before]
        if newly and config["policy"] == "request-level":
            assert not running_before, "request-level admitted while a batch was running"
        admitted.extend(newly)
        # capacity: what is reserved never exceeds the cache
        assert s.kv_cache.num_used_blocks <= s.kv_cache.num_blocks
        for event in s.update(out, sample_eos_at(s, out, accepted)):
            if event.finish_reason is not None:
                finished[event.request_id] = event.finish_reason
        if iteration > 6 and not s.has_unfinished:
            break
    assert set(finished) == set(accepted), "every accepted request ends with a final event"
    assert s.kv_cache.num_used_blocks == 0, "KV leaked"
    assert admitted == sorted(admitted, key=list(accepted).index), "admission is FCFS"


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(["orca", "paged"]), depth=st.integers(1, 4),
       requests=st.lists(request_st, min_size=1, max_size=12), num_blocks=st.integers(6, 40),
       chunked=st.booleans(), threshold=st.sampled_from([0, 1, 5, 25]))
def test_batches_in_flight_never_share_a_request(policy, depth, requests, num_blocks, chunked, threshold):
    """Pipeline parallelism keeps `depth` iterations in flight: a request is never in two of them,
    the runner's token stream (new_requests + new_token_ids) matches the scheduler's, and every
    request still ends with one final event and no leaked KV."""
    s = make_scheduler(policy, num_blocks=num_blocks, block_size=4, max_num_seqs=5, max_num_batched_tokens=48,
                       max_model_len=32, enable_chunked_prefill=chunked, pipeline_depth=depth,
                       long_prefill_token_threshold=threshold)
    accepted: dict[str, int | None] = {}
    finished: set[str] = set()
    runner_tokens: dict[str, list[int]] = {}  # what a pipeline stage knows of each request
    in_flight: list = []
    for iteration in range(2000):  # ends once every request has (12 that fill the context, one at a time, in a pipeline)
        accepted |= add_arrivals(s, requests, iteration)
        out = s.schedule()
        assert_chunks_capped(out, chunked, threshold, 48)
        for rid in out.finished_request_ids + out.preempted_request_ids:
            runner_tokens.pop(rid, None)
        for new in out.new_requests:
            runner_tokens[new.request_id] = list(new.token_ids)
        busy = {item.request_id for batch in in_flight for item in batch.scheduled}
        for item in out.scheduled:
            assert item.request_id not in busy, "a request is in two batches in flight"
            runner_tokens[item.request_id].extend(item.new_token_ids)
            request = s.requests[item.request_id]
            assert runner_tokens[item.request_id] == request.prompt_token_ids + request.output_token_ids
        if out.scheduled:
            in_flight.append(out)
        if len(in_flight) >= depth or (in_flight and not out.scheduled):
            oldest = in_flight.pop(0)
            for event in s.update(oldest, sample_eos_at(s, oldest, accepted, in_flight=True)):
                if event.finish_reason is not None:
                    finished.add(event.request_id)
        if iteration > 6 and not s.has_unfinished and not in_flight:
            break
    assert finished == set(accepted), "every accepted request ends with a final event"
    assert s.kv_cache.num_used_blocks == 0, "KV leaked"
    assert s.num_in_flight == 0
