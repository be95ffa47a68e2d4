"""Async scheduling (core/scheduler.py): iteration N+1 is scheduled before N's result is applied, the
runner feeding back what it sampled. Step traces on tiny configs, and a property test against a fake
worker that checks every input token it is asked to compute is one it already has."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import RunnerOutput, SchedulerOutput
from core.kv_cache import KVCacheManager
from core.policies import make_policy
from core.scheduler import Scheduler
from shared.outputs import FinishReason
from tests.core.helpers import EOS, make_request

VOCAB = 50


def make_async(policy: str = "orca", *, num_blocks: int = 64, block_size: int = 1, max_model_len: int = 64,
               enable_chunked_prefill: bool = False, enable_prefix_caching: bool = False,
               max_num_batched_tokens: int = 256, async_scheduling: bool = True) -> Scheduler:
    return Scheduler(make_policy(policy), KVCacheManager(num_blocks, block_size, enable_prefix_caching),
                     max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     enable_chunked_prefill=enable_chunked_prefill, async_scheduling=async_scheduling)


class FakeWorker:
    """Runs step messages in order as a runner does: request state from NewRequestData and
    new_token_ids, samples kept when the step says so; a greedy 'model' whose next token is a
    function of all tokens before it (EOS where `eos_at` says so)."""

    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.eos_at = eos_at or {}  # request id -> output index that is EOS
        self.prompt_lens: dict[str, int] = {}

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        for rid in output.finished_request_ids + output.preempted_request_ids:
            self.tokens.pop(rid, None)
        new = {n.request_id for n in output.new_requests}
        for n in output.new_requests:
            self.tokens[n.request_id] = list(n.token_ids)
        sampled = {}
        for item in output.scheduled:
            tokens = self.tokens[item.request_id]
            if item.request_id not in new:
                tokens.extend(item.new_token_ids)
            end = item.num_computed_tokens + item.num_new_tokens
            assert end <= len(tokens), f"{item.request_id}: asked to compute position {end - 1} it has no token for"
            if item.samples:
                sampled[item.request_id] = self.next_token(item.request_id, tokens[:end])
        if output.runner_keeps_samples:
            for rid, token in sampled.items():
                self.tokens[rid].append(token)
        return RunnerOutput(sampled_token_ids=sampled)

    def next_token(self, rid: str, prefix: list[int]) -> int:
        num_prompt = self.prompt_lens[rid]
        if len(prefix) - num_prompt == self.eos_at.get(rid):
            return EOS
        return 3 + (sum(prefix) * 31 + len(prefix)) % (VOCAB - 3)


def drive(scheduler: Scheduler, worker: FakeWorker, in_flight: int) -> tuple[dict[str, list[int]], int]:
    """The engine master's loop: keep up to `in_flight` iterations sent, apply results in order.
    Returns every request's tokens and how often a request was scheduled while already in flight."""
    outputs: dict[str, list[int]] = {}
    sent: deque[tuple[SchedulerOutput, RunnerOutput]] = deque()
    ahead = 0
    for _ in range(10_000):
        if not scheduler.has_unfinished and not sent:
            return outputs, ahead
        while len(sent) < in_flight:
            out = scheduler.schedule()
            if out.is_empty:
                break
            busy = {item.request_id for o, _ in sent for item in o.scheduled}
            ahead += sum(item.request_id in busy for item in out.scheduled)
            sent.append((out, worker.execute(out)))  # the worker runs steps in the order sent
        out, result = sent.popleft()
        for event in scheduler.update(out, result):
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
    raise AssertionError("did not finish")


def s_prompt(worker: FakeWorker, rid: str) -> list[int]:
    return [3 + (sum(map(ord, rid)) + i) % (VOCAB - 3) for i in range(worker.prompt_lens[rid])]


def add(scheduler: Scheduler, worker: FakeWorker, rid: str, prompt_len: int, max_tokens: int,
        ignore_eos: bool = True) -> None:
    request = make_request(rid, prompt_len, max_tokens, ignore_eos=ignore_eos,
                           prompt=[3 + (sum(map(ord, rid)) + i) % (VOCAB - 3) for i in range(prompt_len)])
    worker.prompt_lens[rid] = prompt_len
    scheduler.add_request(request)


def test_the_next_iteration_decodes_what_the_running_one_samples():
    s, worker = make_async(), FakeWorker()
    add(s, worker, "a", 4, 5)
    first = s.schedule()  # a's prompt
    assert first.runner_keeps_samples
    ahead = s.schedule()  # before first's result: a decodes the token first samples
    [item] = ahead.scheduled
    assert (item.request_id, item.num_computed_tokens, item.num_new_tokens, item.samples) == ("a", 4, 1, True)
    assert item.new_token_ids == []
    assert s.schedule().is_empty  # never more than one step ahead
    r1 = worker.execute(first)
    r2 = worker.execute(ahead)
    assert [e.new_token_ids for e in s.update(first, r1)] == [(r1.sampled_token_ids["a"],)]
    assert [e.new_token_ids for e in s.update(ahead, r2)] == [(r2.sampled_token_ids["a"],)]
    nxt = s.schedule()
    assert nxt.scheduled[0].new_token_ids == [], "the runner already has the tokens it sampled"


def test_a_request_that_ends_by_length_is_not_scheduled_ahead():
    s, worker = make_async(), FakeWorker()
    add(s, worker, "a", 4, 2)
    first = s.schedule()
    second = s.schedule()  # decodes output 2, which ends it
    assert [i.request_id for i in second.scheduled] == ["a"]
    assert s.schedule().is_empty, "output 2 ends the request: nothing to compute after it"
    s.update(first, worker.execute(first))
    s.update(second, worker.execute(second))
    assert not s.has_unfinished and s.kv_cache.num_used_blocks == 0


def test_a_request_ended_by_eos_wastes_one_step_whose_result_is_ignored():
    s, worker = make_async(), FakeWorker(eos_at={"a": 0})
    add(s, worker, "a", 4, 10, ignore_eos=False)
    first, ahead = s.schedule(), s.schedule()
    events = s.update(first, worker.execute(first))
    assert events[0].new_token_ids == (EOS,) and events[0].finish_reason is not None
    assert s.update(ahead, worker.execute(ahead)) == []
    assert s.kv_cache.num_used_blocks == 0


def test_in_steady_state_every_decode_runs_one_step_ahead():
    sync, worker = make_async(async_scheduling=False), FakeWorker()
    for rid in "abc":
        add(sync, worker, rid, 3, 8)
    expected, none_ahead = drive(sync, worker, in_flight=1)
    s, worker = make_async(), FakeWorker()
    for rid in "abc":
        add(s, worker, rid, 3, 8)
    outputs, ahead = drive(s, worker, in_flight=2)
    assert none_ahead == 0 and outputs == expected
    assert ahead == 3 * 7, "each request's outputs 2..8 are scheduled while the step sampling their input runs"


def test_async_scheduling_refuses_a_pipeline_and_lockstep():
    with pytest.raises(ValueError, match="async scheduling"):
        Scheduler(make_policy("orca"), KVCacheManager(8, 1), max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=64, pipeline_depth=2, async_scheduling=True)
    with pytest.raises(ValueError, match="async scheduling"):
        Scheduler(make_policy("static"), KVCacheManager(8, 1), max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=64, async_scheduling=True)


def test_from_config_turns_it_on_only_where_it_applies():
    from shared.config import CacheConfig, SchedulerConfig

    cache = CacheConfig(kv_cache_tokens=256, block_size=16)
    assert Scheduler.from_config(SchedulerConfig(), cache, 64).async_scheduling
    assert not Scheduler.from_config(SchedulerConfig(async_scheduling=False), cache, 64).async_scheduling
    assert not Scheduler.from_config(SchedulerConfig(), cache, 64, world_size=2).async_scheduling
    assert not Scheduler.from_config(SchedulerConfig(), cache, 64, pipeline_depth=2).async_scheduling
    assert not Scheduler.from_config(SchedulerConfig(policy="static"), cache, 64).async_scheduling


requests_strategy = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12), st.booleans()), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(requests=requests_strategy, policy=st.sampled_from(["orca", "paged", "request-level"]),
       block_size=st.sampled_from([1, 4]), chunked=st.booleans(), prefix=st.booleans(),
       num_blocks=st.integers(12, 40))
def test_async_gives_the_tokens_of_synchronous_scheduling_and_frees_all_kv(requests, policy, block_size, chunked,
                                                                           prefix, num_blocks):
    """Whatever the mix (EOS, length, preemption, chunks, shared prefixes), two iterations in flight
    under async scheduling give every request the tokens one at a time gives, and no KV leaks."""
    if num_blocks * block_size < 26:
        num_blocks = -(-26 // block_size)
    results = []
    for async_scheduling, in_flight in ((False, 1), (True, 2)):
        s = make_async(policy, num_blocks=num_blocks, block_size=block_size, max_model_len=26,
                       enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                       max_num_batched_tokens=8 if chunked else 26, async_scheduling=async_scheduling)
        eos_at = {f"r{i}": max_tokens // 2 for i, (_, max_tokens, eos) in enumerate(requests) if eos}
        worker = FakeWorker(eos_at)
        for i, (prompt_len, max_tokens, eos) in enumerate(requests):
            add(s, worker, f"r{i}", prompt_len, max_tokens, ignore_eos=not eos)
        outputs, _ = drive(s, worker, in_flight)
        assert s.kv_cache.num_used_blocks == 0
        results.append(outputs)
    assert results[0] == results[1]


def test_a_result_of_a_replaced_copy_never_reaches_the_new_copy():
    """The engine master replaces a request by a newer copy with the same id (its tokenizer resumed it)
    while an iteration holding the old copy runs; under async scheduling the new copy can already be in
    the next iteration. The old iteration's result must not be applied to the new copy."""
    s, worker = make_async(), FakeWorker()
    add(s, worker, "a", 4, 20)
    old = s.schedule()  # the old copy's prompt
    s.finish("a", FinishReason.ABORT)  # replaced: no event, as EngineMaster._add does
    resumed = make_request("a", 4, 20, prompt=s_prompt(worker, "a"))
    resumed.output_token_ids = [11, 12]  # the tokens its client already has
    s.add_request(resumed)
    new = s.schedule()  # the new copy's prompt and its two tokens, beside the old iteration in flight
    assert [n.request_id for n in new.new_requests] == ["a"] and "a" in new.finished_request_ids
    assert s.update(old, RunnerOutput(sampled_token_ids={"a": 33})) == []
    assert resumed.output_token_ids == [11, 12] and resumed.num_computed_tokens == 0
    [event] = s.update(new, RunnerOutput(sampled_token_ids={"a": 44}))
    assert event.new_token_ids == (44,) and resumed.output_token_ids == [11, 12, 44]
    assert resumed.num_computed_tokens == 6
