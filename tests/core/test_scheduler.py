"""Step traces of the iteration scheduler on tiny configs, with hand-built step results."""

from __future__ import annotations

import pytest

from shared.outputs import FinishReason
from tests.core.helpers import EOS, fake_step, make_request, make_scheduler, run_to_end


def scheduled_tokens(output) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in output.scheduled}


def test_prefill_and_decodes_share_an_iteration():
    s = make_scheduler()
    s.add_request(make_request("a", 5, 3))
    out = s.schedule()
    assert scheduled_tokens(out) == {"a": 5}
    s.update(out, fake_step(out))
    s.add_request(make_request("b", 4, 3))
    out = s.schedule()
    assert scheduled_tokens(out) == {"a": 1, "b": 4}  # a decodes while b prefills: one batch
    assert [r.request_id for r in out.new_requests] == ["b"]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 4


def test_finished_request_leaves_after_the_iteration_that_finished_it():
    s = make_scheduler()
    s.add_request(make_request("a", 3, 2))
    s.add_request(make_request("b", 3, 5))
    out = s.schedule()
    s.update(out, fake_step(out))
    out = s.schedule()
    events = s.update(out, fake_step(out))
    assert {e.request_id: e.finish_reason for e in events} == {"a": FinishReason.LENGTH, "b": None}
    out = s.schedule()
    assert scheduled_tokens(out) == {"b": 1}
    assert out.finished_request_ids == ["a"]


def test_orca_reserves_prompt_plus_max_tokens_and_releases_exactly_that():
    s = make_scheduler(num_blocks=20)
    s.add_request(make_request("a", 5, 10))
    out = s.schedule()
    assert s.kv_cache.num_used_blocks == 15
    s.update(out, fake_step(out, {"a": EOS}))  # EOS ignored: ignore_eos
    assert s.kv_cache.num_used_blocks == 15
    run_to_end(s)
    assert s.kv_cache.num_used_blocks == 0


def test_eos_stops_unless_ignored():
    s = make_scheduler()
    s.add_request(make_request("a", 3, 10, ignore_eos=False))
    out = s.schedule()
    events = s.update(out, fake_step(out, {"a": EOS}))
    assert events[0].finish_reason is FinishReason.STOP
    assert not s.has_unfinished and s.kv_cache.num_used_blocks == 0


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    s = make_scheduler(num_blocks=20)
    s.add_request(make_request("a", 5, 5))   # 10 slots
    s.add_request(make_request("big", 5, 10))  # 15 slots: does not fit beside a
    s.add_request(make_request("small", 1, 1))  # 2 slots would fit, but must not skip ahead
    out = s.schedule()
    assert scheduled_tokens(out) == {"a": 5}
    s.update(out, fake_step(out))
    run_to_end(s)


def test_max_num_seqs_bounds_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 2, 3))
    out = s.schedule()
    assert set(scheduled_tokens(out)) == {"r0", "r1"}


def test_request_level_never_admits_while_a_batch_runs():
    s = make_scheduler("request-level", max_num_seqs=4)
    s.add_request(make_request("a", 2, 1))
    s.add_request(make_request("b", 2, 4))
    out = s.schedule()
    s.update(out, fake_step(out))  # a finishes now
    s.add_request(make_request("c", 2, 1))
    for _ in range(3):
        out = s.schedule()
        assert "c" not in scheduled_tokens(out)
        s.update(out, fake_step(out))
    out = s.schedule()
    assert scheduled_tokens(out) == {"c": 2}


def test_abort_waiting_and_running_frees_kv():
    s = make_scheduler(num_blocks=10)
    s.add_request(make_request("a", 3, 5))
    s.add_request(make_request("b", 3, 5))
    out = s.schedule()
    assert s.abort("b").finish_reason is FinishReason.ABORT  # still waiting: did not fit
    s.update(out, fake_step(out))
    assert s.abort("a").finish_reason is FinishReason.ABORT
    assert s.kv_cache.num_used_blocks == 0 and not s.has_unfinished
    assert s.abort("a") is None
    assert s.schedule().is_empty  # nothing to run: the runner hears of "a" with the next batch
    s.add_request(make_request("c", 3, 1))
    assert s.schedule().finished_request_ids == ["a"]


def test_abort_during_an_iteration_drops_its_result():
    s = make_scheduler()
    s.add_request(make_request("a", 3, 5))
    out = s.schedule()
    s.abort("a")
    assert s.update(out, fake_step(out)) == []


@pytest.mark.parametrize("max_tokens", [100, None], ids=["past-the-context", "null"])
def test_context_full_finishes_with_length(max_tokens):
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("a", 6, max_tokens))
    events = []
    while s.has_unfinished:
        out = s.schedule()
        events += s.update(out, fake_step(out))
    assert [e.finish_reason for e in events] == [None, FinishReason.LENGTH]


@pytest.mark.parametrize("prompt_len,max_tokens,error", [
    (0, 4, "empty"), (64, 1, "context"), (10, 60, "cache holds"),
])
def test_requests_that_can_never_run_are_refused_up_front(prompt_len, max_tokens, error):
    s = make_scheduler(num_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match=error):
        s.add_request(make_request("a", prompt_len, max_tokens))


def test_duplicate_request_id_is_refused():
    s = make_scheduler()
    s.add_request(make_request("a", 3, 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 3, 3))


def test_token_budget_defers_prefill_without_chunking():
    s = make_scheduler(num_blocks=128, max_num_batched_tokens=64, max_model_len=64)
    s.add_request(make_request("a", 40, 2))
    s.add_request(make_request("b", 40, 2))
    out = s.schedule()
    assert scheduled_tokens(out) == {"a": 40}
    s.update(out, fake_step(out))
    out = s.schedule()
    assert scheduled_tokens(out) == {"a": 1, "b": 40}


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=True)
    s.add_request(make_request("a", 40, 2))
    chunks = []
    while True:
        out = s.schedule()
        item = out.scheduled[0]
        chunks.append((item.num_new_tokens, item.samples))
        s.update(out, fake_step(out))
        if item.samples:
            break
    assert chunks == [(16, False), (16, False), (8, True)]


def test_budget_below_context_without_chunking_is_a_config_error():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=32, max_model_len=64)


def test_a_pipeline_of_depth_two_splits_the_running_requests_between_two_batches():
    s = make_scheduler(max_num_seqs=4, pipeline_depth=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 3, 4))
    first, second = s.schedule(), s.schedule()  # the first is still in flight when the second is made
    assert set(scheduled_tokens(first)) == {"r0", "r1"} and set(scheduled_tokens(second)) == {"r2", "r3"}
    assert s.schedule().is_empty  # everyone is in flight
    s.update(first, fake_step(first))
    assert set(scheduled_tokens(s.schedule())) == {"r0", "r1"}


def test_a_null_max_tokens_runs_until_the_cache_is_full_where_it_holds_less_than_the_context():
    """A cache of 8 slots under a 64-token context: null means until the cache is full (5 tokens after a
    3-token prompt), not a refusal for wanting the whole context's KV."""
    s = make_scheduler(num_blocks=8, block_size=1, max_model_len=64)
    s.add_request(make_request("a", 3, None))
    events = []
    while s.has_unfinished:
        out = s.schedule()
        events += s.update(out, fake_step(out))
    assert len(events) == 5 and events[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="the KV cache holds 8, leaving no room"):
        s.add_request(make_request("b", 8, None))
