"""Paged KV with preemption, prefix reuse and priorities: step traces and properties."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import RunnerOutput
from shared.outputs import FinishReason
from tests.core.helpers import EOS, fake_step, make_request, make_scheduler, run_to_end


def test_paged_admits_on_the_prompt_alone_where_orca_reserves_everything():
    orca, paged = make_scheduler("orca", num_blocks=40), make_scheduler("paged", num_blocks=40)
    for s in (orca, paged):
        for i in range(4):
            s.add_request(make_request(f"r{i}", 8, 20))  # 28 slots each under Orca
    assert len(orca.schedule().scheduled) == 1
    assert len(paged.schedule().scheduled) == 4


def test_paged_preempts_the_latest_admitted_and_it_resumes_with_its_tokens():
    s = make_scheduler("paged", num_blocks=12, block_size=1, max_model_len=32)
    s.add_request(make_request("old", 4, 8))
    s.add_request(make_request("new", 4, 8))
    preempted_at = None
    tokens: dict[str, list[int]] = {"old": [], "new": []}
    for iteration in range(40):
        if not s.has_unfinished:
            break
        out = s.schedule()
        if out.preempted_request_ids and preempted_at is None:
            preempted_at = iteration
            assert out.preempted_request_ids == ["new"]
            assert s.requests["new"].output_token_ids  # kept
        step = {x.request_id: 100 + len(s.requests[x.request_id].output_token_ids) for x in out.scheduled if x.samples}
        for event in s.update(out, RunnerOutput(sampled_token_ids=step)):
            tokens[event.request_id].extend(event.new_token_ids)
    assert preempted_at is not None and s.num_preemptions >= 1
    assert tokens == {"old": list(range(100, 108)), "new": list(range(100, 108))}  # no token lost or repeated
    assert s.kv_cache.num_used_blocks == 0


def test_a_resumed_request_is_sent_to_the_runner_again_with_prompt_and_outputs():
    s = make_scheduler("paged", num_blocks=14, block_size=1, max_model_len=32)
    s.add_request(make_request("a", 3, 10))
    s.add_request(make_request("b", 3, 10))
    resumed = None
    for _ in range(60):
        if not s.has_unfinished:
            break
        out = s.schedule()
        for new in out.new_requests:
            if new.request_id == "b" and len(new.token_ids) > 3:
                resumed = new
        s.update(out, fake_step(out))
    assert resumed is not None and resumed.num_prompt_tokens == 3 and resumed.token_ids[:3] == [10, 11, 12]


def test_shared_prefix_is_computed_once():
    s = make_scheduler("orca", num_blocks=64, block_size=4, enable_prefix_caching=True)
    system = list(range(100, 112))  # three full blocks
    s.add_request(make_request("first", 0, 2, prompt=system + [1, 2]))
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 14
    s.update(out, fake_step(out))
    s.add_request(make_request("second", 0, 2, prompt=system + [3]))
    out = s.schedule()
    second = next(x for x in out.scheduled if x.request_id == "second")
    assert second.num_computed_tokens == 12 and second.num_new_tokens == 1
    assert s.kv_cache.block_ids("second")[:3] == s.kv_cache.block_ids("first")[:3]
    s.update(out, fake_step(out))
    run_to_end(s)
    s.kv_cache.check()
    assert s.kv_cache.num_used_blocks == 0


def test_a_cache_salt_shares_prefixes_only_among_requests_with_the_same_salt():
    """vLLM's cache_salt: a tenant's requests reuse each other's prefixes; nobody else's, salted or not (the
    first block's key holds the salt and every later key chains from it)."""
    import dataclasses

    s = make_scheduler("orca", num_blocks=64, block_size=4, enable_prefix_caching=True)
    system = list(range(100, 112))  # three full blocks

    def computed(rid: str, salt: str | None) -> int:
        s.add_request(dataclasses.replace(make_request(rid, 0, 1, prompt=system + [1]), cache_salt=salt))
        out = s.schedule()
        computed = next(x for x in out.scheduled if x.request_id == rid).num_computed_tokens
        s.update(out, fake_step(out))
        return computed

    assert computed("a", "tenant-a") == 0
    assert computed("b", "tenant-a") == 12, "the same salt reuses"
    assert computed("c", "tenant-b") == 0 and computed("d", None) == 0, "another salt, or none, does not"
    assert computed("e", None) == 12 and computed("f", "tenant-b") == 12, "each reuses its own"
    run_to_end(s)
    s.kv_cache.check()


def test_cached_blocks_survive_their_request_and_are_evicted_lru_when_space_is_needed():
    s = make_scheduler("paged", num_blocks=8, block_size=4, enable_prefix_caching=True, max_model_len=32)
    s.add_request(make_request("a", 0, 1, prompt=list(range(100, 109))))
    run_to_end(s)
    assert s.kv_cache.num_used_blocks == 0 and s.kv_cache.num_free_blocks == 8
    s.add_request(make_request("b", 0, 1, prompt=list(range(100, 109))))
    out = s.schedule()
    assert out.scheduled[0].num_computed_tokens == 8  # reused after 'a' ended
    s.update(out, fake_step(out))
    s.add_request(make_request("c", 0, 1, prompt=list(range(200, 228))))  # needs all 8 blocks: evicts
    run_to_end(s)
    s.kv_cache.check()


def test_priority_orders_admission_and_is_fcfs_within_a_priority():
    s = make_scheduler("orca", num_blocks=20, max_num_seqs=1)
    s.add_request(make_request("low", 2, 1, priority=5))
    s.add_request(make_request("high-1", 2, 1, priority=0))
    s.add_request(make_request("high-2", 2, 1, priority=0))
    order = [o.new_requests[0].request_id for o in run_to_end(s) if o.new_requests]
    assert order == ["high-1", "high-2", "low"]


request_st = st.tuples(
    st.integers(0, 6), st.integers(1, 20), st.integers(1, 12),
    st.one_of(st.none(), st.integers(0, 12)), st.one_of(st.none(), st.integers(0, 40)), st.integers(0, 2),
    st.sampled_from([(), (7, 8, 9, 10, 11, 12, 13, 14)]),  # optional shared prefix
)


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(["orca", "request-level", "paged"]), block_size=st.sampled_from([1, 4]),
       prefix=st.booleans(), chunked=st.booleans(), max_num_seqs=st.integers(1, 6),
       num_blocks=st.integers(8, 40), requests=st.lists(request_st, min_size=1, max_size=10))
def test_no_leak_no_double_free_no_lost_token(policy, block_size, prefix, chunked, max_num_seqs, num_blocks,
                                              requests):
    s = make_scheduler(policy, num_blocks=num_blocks * 4 // block_size, block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=48 if chunked else 200, max_model_len=32,
                       enable_chunked_prefill=chunked, enable_prefix_caching=prefix)
    accepted, finished, streamed = {}, {}, {}
    for iteration in range(800):
        for i, (arrival, plen, max_tokens, eos_at, abort_at, priority, shared) in enumerate(requests):
            rid = f"r{i}"
            if arrival == iteration:
                prompt = list(shared) + [50 + i] * plen
                try:
                    s.add_request(make_request(rid, 0, max_tokens, ignore_eos=eos_at is None, priority=priority,
                                               prompt=prompt[:31]))
                except ValueError:
                    continue
                accepted[rid], streamed[rid] = eos_at, []
            if abort_at == iteration and rid in accepted and rid not in finished:
                finished[rid] = s.abort(rid).finish_reason
        out = s.schedule()
        s.kv_cache.check()
        sampled = {}
        for item in out.scheduled:
            if item.samples:
                request = s.requests[item.request_id]
                n = len(request.output_token_ids)
                sampled[item.request_id] = EOS if accepted[item.request_id] == n else 1000 + n
        for event in s.update(out, RunnerOutput(sampled_token_ids=sampled)):
            streamed[event.request_id].extend(event.new_token_ids)
            if event.finish_reason is not None:
                finished[event.request_id] = event.finish_reason
        s.kv_cache.check()
        if iteration > 6 and not s.has_unfinished:
            break
    assert set(finished) == set(accepted), "every accepted request ends"
    assert s.kv_cache.num_used_blocks == 0, "KV leaked"
    for rid, tokens in streamed.items():  # each output position exactly once, in order, preemptions or not
        expected = [EOS if accepted[rid] == n else 1000 + n for n in range(len(tokens))]
        assert tokens == expected, rid
        if finished[rid] is FinishReason.LENGTH:
            assert tokens and len(tokens) >= 1
