"""The static policy (FasterTransformer behind a request-level server): step traces, one per
invariant, and a property test over random workloads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.outputs import FinishReason
from tests.core.helpers import (EOS, abort_due, add_arrivals, fake_step, make_request, make_scheduler, sample_eos_at,
                                workload_requests)


def lanes(output) -> dict[str, tuple[int, bool]]:
    return {s.request_id: (s.num_new_tokens, s.samples) for s in output.scheduled}


def static(**kwargs):
    kwargs.setdefault("max_model_len", 16)
    return make_scheduler("static", **kwargs)


def test_first_iteration_is_the_shortest_prompt_in_every_lane_then_one_token_per_lane():
    s = static()
    s.add_request(make_request("a", 3, 2))
    s.add_request(make_request("b", 5, 2))
    trace = []
    while s.has_unfinished:
        out = s.schedule()
        trace.append(lanes(out))
        s.update(out, fake_step(out))
    assert trace == [
        {"a": (3, True), "b": (3, False)},  # b's first 3 prompt tokens only
        {"a": (1, True), "b": (1, False)},  # a decodes, b's 4th prompt token; a is done after this
        {"a": (1, False), "b": (1, True)},  # a is a dead lane; b's last prompt token samples
        {"a": (1, False), "b": (1, True)},  # b's second token: the batch's longest lane ends
    ]
    # iterations = max(prompt + max_tokens) - min(prompt) = 7 - 3
    assert len(trace) == 4


def test_the_batch_is_fixed_no_one_joins_it_and_the_next_starts_from_the_queue():
    s = static(max_num_seqs=4)
    s.add_request(make_request("a", 3, 1))
    s.add_request(make_request("b", 3, 4))
    out = s.schedule()
    s.add_request(make_request("c", 2, 1))  # arrives while the batch runs, a lane is free
    while out.scheduled and "c" not in lanes(out):
        assert set(lanes(out)) == {"a", "b"}  # every lane, every iteration, and nobody else
        s.update(out, fake_step(out))
        out = s.schedule()
    assert lanes(out) == {"c": (2, True)} and [r.request_id for r in out.new_requests] == ["c"]
    assert out.finished_request_ids == ["a", "b"]  # the runner drops both lanes only now


def test_a_finished_request_keeps_its_lane_computing_wasted_tokens_until_the_batch_ends():
    s = static()
    s.add_request(make_request("a", 4, 1))
    s.add_request(make_request("b", 4, 4))
    out = s.schedule()
    s.update(out, fake_step(out, {"a": 40, "b": 50}))  # a is done
    dead = []
    while s.has_unfinished:
        out = s.schedule()
        assert out.dead_request_ids == ["a"] and out.num_dead_tokens == 1
        item = next(x for x in out.scheduled if x.request_id == "a")
        assert not item.samples and item.num_new_tokens == 1
        dead.append((item.num_computed_tokens, item.new_token_ids))
        s.update(out, fake_step(out))
    # its last token goes in first, then filler (that token again), at the batch's positions
    assert dead == [(4, [40]), (5, [40]), (6, [40])]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 0


def test_outputs_return_together_when_the_batch_ends():
    s = static()
    s.add_request(make_request("a", 3, 1))
    s.add_request(make_request("b", 3, 3, ignore_eos=False))
    events = []
    while s.has_unfinished:
        out = s.schedule()
        events.append(s.update(out, fake_step(out, {"a": 11, "b": 12})))
    assert events[:-1] == [[], []]
    assert {e.request_id: (e.new_token_ids, e.finish_reason) for e in events[-1]} == {
        "a": ((11,), FinishReason.LENGTH), "b": ((12, 12, 12), FinishReason.LENGTH)}


def test_eos_makes_a_dead_lane_too():
    s = static()
    s.add_request(make_request("a", 3, 5, ignore_eos=False))
    s.add_request(make_request("b", 3, 3))
    out = s.schedule()
    assert s.update(out, fake_step(out, {"a": EOS})) == []
    out = s.schedule()
    assert out.dead_request_ids == ["a"]


def test_every_lane_preallocates_the_whole_context_and_releases_it_when_the_batch_ends():
    s = static(num_blocks=40, block_size=1, max_model_len=16)
    s.add_request(make_request("a", 3, 1))  # needs 4 slots, reserves 16
    s.add_request(make_request("b", 3, 6))
    s.add_request(make_request("c", 3, 1))  # a third lane would need 48 > 40: waits for the next batch
    used = []
    while s.has_unfinished:
        out = s.schedule()
        used.append(s.kv_cache.num_used_blocks)
        s.update(out, fake_step(out))
        s.kv_cache.check()
    assert used[:6] == [32] * 6  # a's lane stays reserved after a finished (iteration 1)
    assert used[6:] == [16]  # then c's batch
    assert s.kv_cache.num_used_blocks == 0


def test_a_request_whose_lane_cannot_fit_is_refused_up_front():
    s = static(num_blocks=12, block_size=1, max_model_len=16)
    with pytest.raises(ValueError, match="16 KV slots under the static policy"):
        s.add_request(make_request("a", 3, 2))


def test_token_budget_caps_the_lanes_and_the_first_iteration():
    s = static(num_blocks=200, block_size=1, max_model_len=16, max_num_batched_tokens=16, max_num_seqs=8)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 12, 2))
    out = s.schedule()
    assert {n for n, _ in lanes(out).values()} == {3} and len(out.scheduled) == 5  # 5 lanes x 3 <= 16


def test_a_batch_in_flight_runs_alone_even_with_a_deep_pipeline():
    s = static(pipeline_depth=2, max_num_seqs=4)
    s.add_request(make_request("a", 3, 2))
    first = s.schedule()
    s.add_request(make_request("b", 3, 2))
    assert s.schedule().is_empty  # one dense batch: nothing can be in flight beside it
    s.update(first, fake_step(first))
    assert set(lanes(s.schedule())) == {"a"}


def test_abort_frees_a_lane_at_once_and_the_rest_of_the_batch_runs_on():
    s = static(num_blocks=64, block_size=1)
    s.add_request(make_request("a", 3, 1))
    s.add_request(make_request("b", 3, 4))
    out = s.schedule()
    s.update(out, fake_step(out))
    assert s.abort("a").finish_reason is FinishReason.ABORT  # dead, held output dropped
    assert s.kv_cache.num_used_blocks == 16
    out = s.schedule()
    assert set(lanes(out)) == {"b"} and out.finished_request_ids == ["a"]
    s.update(out, fake_step(out))
    s.abort("b")
    assert not s.has_unfinished and s.kv_cache.num_used_blocks == 0


def test_preempted_batch_resumes_and_dead_lanes_do_not_generate_again():
    s = static(num_blocks=64, block_size=1)
    s.add_request(make_request("a", 3, 1))
    s.add_request(make_request("b", 3, 3))
    out = s.schedule()
    s.update(out, fake_step(out))  # a done (dead), b has 1 token
    assert sorted(s.preempt_all()) == ["a", "b"]
    assert s.kv_cache.num_used_blocks == 0
    events = []
    while s.has_unfinished:
        out = s.schedule()
        assert not any(x.samples for x in out.scheduled if x.request_id == "a")
        events += s.update(out, fake_step(out))
    assert {e.request_id: len(e.new_token_ids) for e in events} == {"a": 1, "b": 3}
    assert s.kv_cache.num_used_blocks == 0


def test_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="prefix"):
        make_scheduler("static", enable_prefix_caching=True)


# ---- property test ----------------------------------------------------------------------

request_st = workload_requests(last_arrival=8, max_prompt_len=12, max_tokens=10, last_abort=40)


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=10), max_num_seqs=st.integers(1, 5),
       block_size=st.sampled_from([1, 4]), num_blocks=st.integers(8, 24), budget=st.sampled_from([24, 64]))
def test_static_batch_invariants(requests, max_num_seqs, block_size, num_blocks, budget):
    """Whatever arrives: a batch is fixed once it starts and runs every lane in every iteration;
    its lanes share one position after the first iteration; dead lanes never sample; the runner's
    token stream matches the scheduler's; lane KV stays reserved until the batch ends; outputs
    return only at a batch's end (or an abort); every request ends once, FCFS, and no KV leaks."""
    s = make_scheduler("static", num_blocks=num_blocks * 16 // block_size, block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=16)
    accepted: dict[str, int | None] = {}  # in arrival order
    finished: set[str] = set()
    admitted: list[str] = []
    runner: dict[str, list[int]] = {}
    batch: list[str] = []
    for iteration in range(800):
        accepted |= add_arrivals(s, requests, iteration)
        for event in abort_due(s, requests, iteration, live=accepted.keys() - finished):
            finished.add(event.request_id)
            batch = [b for b in batch if b != event.request_id]
        out = s.schedule()
        for rid in out.finished_request_ids:
            runner.pop(rid, None)
        for new in out.new_requests:
            runner[new.request_id] = list(new.token_ids)
        ids = [x.request_id for x in out.scheduled]
        if ids and batch:
            assert ids == batch, "a running batch changed"
        elif ids:
            admitted += ids
            batch = ids
        used = s.kv_cache.num_used_blocks
        assert used == len(batch) * s.kv_cache.blocks_needed(16), "every lane holds the whole context"
        positions = set()
        for item in out.scheduled:
            request = s.requests[item.request_id]
            runner[item.request_id].extend(item.new_token_ids)
            known = request.prompt_token_ids + request.output_token_ids
            assert runner[item.request_id][:len(known)] == known
            assert len(runner[item.request_id]) >= item.num_computed_tokens + item.num_new_tokens
            assert not (item.samples and request.finish_reason is not None), "a dead lane sampled"
            positions.add(item.num_computed_tokens)
        assert len(positions) <= 1 or all(x.num_computed_tokens == 0 for x in out.scheduled)
        events = s.update(out, sample_eos_at(s, out, accepted))
        if events:
            assert all(e.finish_reason is not None for e in events), "an output returned before its batch ended"
            assert {e.request_id for e in events} == set(batch), "the whole batch returns at once"
            finished.update(e.request_id for e in events)
            batch = []
        if iteration > 8 and not s.has_unfinished:
            break
    assert finished == set(accepted), "every accepted request ends with a final event"
    assert s.kv_cache.num_used_blocks == 0, "KV leaked"
    assert admitted == sorted(admitted, key=list(accepted).index), "admission is FCFS"
