"""Property tests: whatever the workload, the scheduler keeps its promises."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import RunnerOutput
from tests.core.helpers import EOS, make_request, make_scheduler

request_st = st.tuples(
    st.integers(0, 6),  # arrival iteration
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 12)),  # output index at which EOS is sampled
    st.one_of(st.none(), st.integers(0, 30)),  # iteration at which the client aborts
)
config_st = st.fixed_dictionaries({
    "policy": st.sampled_from(["orca", "request-level"]),
    "block_size": st.sampled_from([1, 4]),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.sampled_from([32, 48, 200]),
    "enable_chunked_prefill": st.booleans(),
})


@settings(max_examples=300, deadline=None)
@given(config=config_st, requests=st.lists(request_st, min_size=1, max_size=12), num_blocks=st.integers(10, 40))
def test_scheduler_invariants(config, requests, num_blocks):
    block_size = config["block_size"]
    s = make_scheduler(config["policy"], num_blocks=num_blocks * 4 // block_size, block_size=block_size,
                       max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["max_num_batched_tokens"],
                       max_model_len=32, enable_chunked_prefill=config["enable_chunked_prefill"])
    accepted: dict[str, tuple] = {}
    finished: dict[str, object] = {}
    admitted: list[str] = []
    arrival_rank: dict[str, int] = {}
    for iteration in range(500):
        for i, (arrival, prompt_len, max_tokens, eos_at, abort_at) in enumerate(requests):
            rid = f"r{i}"
            if arrival == iteration:
                try:
                    s.add_request(make_request(rid, prompt_len, max_tokens, ignore_eos=eos_at is None))
                except ValueError:
                    continue  # refused up front (too long for this cache): fine, it never entered
                accepted[rid] = (eos_at, abort_at)
                arrival_rank[rid] = len(arrival_rank)
            if abort_at == iteration and rid in accepted and rid not in finished:
                event = s.abort(rid)
                assert event is not None
                finished[rid] = event.finish_reason
        running_before = {r.request_id for r in s.running}
        out = s.schedule()
        newly = [r.request_id for r in s.running if r.request_id not in running_before]
        if newly and config["policy"] == "request-level":
            assert not running_before, "request-level admitted while a batch was running"
        admitted.extend(newly)
        # capacity: what is reserved never exceeds the cache
        assert s.kv_cache.num_used_blocks <= s.kv_cache.num_blocks
        sampled = {}
        for item in out.scheduled:
            if item.samples:
                request = s.requests[item.request_id]
                eos_at = accepted[item.request_id][0]
                sampled[item.request_id] = EOS if eos_at == len(request.output_token_ids) else 7
        for event in s.update(out, RunnerOutput(sampled_token_ids=sampled)):
            if event.finish_reason is not None:
                finished[event.request_id] = event.finish_reason
        if iteration > 6 and not s.has_unfinished:
            break
    assert set(finished) == set(accepted), "every accepted request ends with a final event"
    assert s.kv_cache.num_used_blocks == 0, "KV leaked"
    assert admitted == sorted(admitted, key=arrival_rank.__getitem__), "admission is FCFS"


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(["orca", "paged"]), depth=st.integers(1, 4),
       requests=st.lists(request_st, min_size=1, max_size=12), num_blocks=st.integers(6, 40),
       chunked=st.booleans())
def test_batches_in_flight_never_share_a_request(policy, depth, requests, num_blocks, chunked):
    """Pipeline parallelism keeps `depth` iterations in flight: a request is never in two of them,
    the runner's token stream (new_requests + new_token_ids) matches the scheduler's, and every
    request still ends with one final event and no leaked KV."""
    s = make_scheduler(policy, num_blocks=num_blocks, block_size=4, max_num_seqs=5, max_num_batched_tokens=48,
                       max_model_len=32, enable_chunked_prefill=chunked, pipeline_depth=depth)
    accepted: dict[str, int | None] = {}
    finished: set[str] = set()
    runner_tokens: dict[str, list[int]] = {}  # what a pipeline stage knows of each request
    in_flight: list = []
    for iteration in range(600):
        for i, (arrival, prompt_len, max_tokens, eos_at, _) in enumerate(requests):
            if arrival == iteration:
                try:
                    s.add_request(make_request(f"r{i}", prompt_len, max_tokens, ignore_eos=eos_at is None))
                    accepted[f"r{i}"] = eos_at
                except ValueError:
                    pass
        out = s.schedule()
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
            sampled = {}
            for item in oldest.scheduled:
                request = s.requests.get(item.request_id)
                if item.samples and request is not None:
                    sampled[item.request_id] = EOS if accepted[item.request_id] == len(request.output_token_ids) else 7
            for event in s.update(oldest, RunnerOutput(sampled_token_ids=sampled)):
                if event.finish_reason is not None:
                    finished.add(event.request_id)
        if iteration > 6 and not s.has_unfinished and not in_flight:
            break
    assert finished == set(accepted), "every accepted request ends with a final event"
    assert s.kv_cache.num_used_blocks == 0, "KV leaked"
    assert s.num_in_flight == 0
