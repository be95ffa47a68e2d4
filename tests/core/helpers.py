"""Tiny scheduler set-ups and a hand-driven 'model' for step-trace tests."""

from __future__ import annotations

from collections.abc import Collection

from hypothesis import strategies as st

from core.batch import RunnerOutput, SchedulerOutput
from core.kv_cache import KVCacheManager
from core.policies import make_policy
from core.request import Request
from core.scheduler import Scheduler
from shared.outputs import RequestOutput
from shared.sampling import SamplingParams

EOS = 2


def make_scheduler(policy: str = "orca", *, num_blocks: int = 64, block_size: int = 1, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 256, max_model_len: int = 64,
                   enable_chunked_prefill: bool = False, enable_prefix_caching: bool = False,
                   pipeline_depth: int = 1, long_prefill_token_threshold: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(make_policy(policy), kv, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     enable_chunked_prefill=enable_chunked_prefill, pipeline_depth=pipeline_depth,
                     long_prefill_token_threshold=long_prefill_token_threshold)


def make_request(request_id: str, prompt_len: int, max_tokens: int | None, ignore_eos: bool = True, priority: int = 0,
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


# ---- random workloads, for the property tests ----------------------------------------------------

Workload = list[tuple[int, int, int | None, int | None, int | None]]
"""Per request r<i>: (arrival iteration, prompt length, max_tokens (None: until the context is full), output index at which EOS is
sampled or None, iteration at which the client aborts or None)."""


def workload_requests(last_arrival: int, max_prompt_len: int, max_tokens: int, last_abort: int) -> st.SearchStrategy:
    """One Workload entry, each field drawn up to its bound."""
    return st.tuples(
        st.integers(0, last_arrival),  # arrival iteration
        st.integers(1, max_prompt_len),  # prompt length
        st.one_of(st.none(), st.integers(1, max_tokens)),  # max_tokens
        st.one_of(st.none(), st.integers(0, max_tokens)),  # output index at which EOS is sampled
        st.one_of(st.none(), st.integers(0, last_abort)),  # iteration at which the client aborts
    )


def add_arrivals(scheduler: Scheduler, workload: Workload, iteration: int) -> dict[str, int | None]:
    """Queue the requests that arrive at `iteration`; return each accepted one's EOS index. One
    refused up front (too long for this cache) never enters: fine, and left out."""
    accepted: dict[str, int | None] = {}
    for i, (arrival, prompt_len, max_tokens, eos_at, _) in enumerate(workload):
        if arrival == iteration:
            try:
                scheduler.add_request(make_request(f"r{i}", prompt_len, max_tokens, ignore_eos=eos_at is None))
            except ValueError:
                continue
            accepted[f"r{i}"] = eos_at
    return accepted


def abort_due(scheduler: Scheduler, workload: Workload, iteration: int, live: Collection[str]) -> list[RequestOutput]:
    """Abort each `live` request whose client aborts at `iteration`; the scheduler knows every one."""
    events = []
    for i, (*_, abort_at) in enumerate(workload):
        if abort_at == iteration and f"r{i}" in live:
            event = scheduler.abort(f"r{i}")
            assert event is not None
            events.append(event)
    return events


def sample_eos_at(scheduler: Scheduler, output: SchedulerOutput, eos_at: dict[str, int | None],
                  in_flight: bool = False) -> RunnerOutput:
    """The model's step result: EOS where a request's output reaches its EOS index, token 7 elsewhere.
    With batches `in_flight` (pipeline parallelism), a request that ended in one ahead samples nothing."""
    sampled = {}
    for item in output.scheduled:
        if not item.samples or (in_flight and item.request_id not in scheduler.requests):
            continue
        request = scheduler.requests[item.request_id]
        sampled[item.request_id] = EOS if eos_at[item.request_id] == len(request.output_token_ids) else 7
    return RunnerOutput(sampled_token_ids=sampled)
