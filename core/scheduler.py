"""The iteration scheduler: picks every iteration's batch. Pure: no torch, no I/O, no clock.

Two verbs: `schedule()` decides the next iteration; `update(output, result)` applies
what the model produced and returns events. Requests are admitted FCFS by the admission
policy (stopping at the first that does not fit: no skipping, no starvation), then
scheduled by token budget: running decodes first, then prefills, in admission order, so
a prefill and other requests' decodes share one iteration (selective batching).
"""

from __future__ import annotations

from collections import deque

from core.batch import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from core.kv_cache import KVCacheManager
from core.policies import AdmissionPolicy
from core.request import Request, RequestStatus
from shared.outputs import FinishReason, RequestOutput


class Scheduler:
    def __init__(
        self,
        policy: AdmissionPolicy,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = False,
    ) -> None:
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below max_model_len={max_model_len}: "
                "a long prompt could never run; raise it or enable chunked prefill"
            )
        self.policy = policy
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._iteration = 0
        self._arrivals = 0
        self._finished_since_schedule: list[str] = []
        self._seen_by_runner: set[str] = set()

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never be served here."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the model's context is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        reserve = self.policy.reservation(request, self.max_model_len)
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if self.kv_cache.blocks_needed(reserve) > self.kv_cache.num_blocks:
            raise ValueError(
                f"request needs {reserve} KV slots (prompt + max_tokens) but the cache holds {capacity}"
            )
        request.arrival_order = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> RequestOutput | None:
        """End a request from outside the model (abort, stop string, error); None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._end(request, reason)
        return RequestOutput(request_id, finish_reason=reason, error=error)

    @property
    def iteration(self) -> int:
        """Iterations scheduled so far."""
        return self._iteration

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the two verbs --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        num_running_at_start = len(self.running)
        if self.policy.admission_open(num_running_at_start):
            self._admit()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        for request in self._decodes_then_prefills():
            num_new = self._tokens_this_iteration(request, budget)
            if num_new == 0:
                continue
            new_blocks = self.kv_cache.allocate(request.request_id, request.num_computed_tokens + num_new)
            assert new_blocks is not None, "tokens were scheduled beyond the request's reservation"
            scheduled.append(ScheduledRequest(
                request.request_id, request.num_computed_tokens, num_new, new_blocks,
                samples=request.num_computed_tokens + num_new == request.num_tokens,
            ))
            budget -= num_new
        output = SchedulerOutput(
            iteration=self._iteration,
            new_requests=self._new_request_data(scheduled),
            scheduled=scheduled,
            finished_request_ids=self._finished_since_schedule,
        )
        self._finished_since_schedule = []
        self._iteration += 1
        self._check_invariants(output)
        return output

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        events: list[RequestOutput] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:  # aborted while the iteration ran
                continue
            request.num_computed_tokens += item.num_new_tokens
            token = result.sampled_token_ids.get(item.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._end(request, reason)
            logprob = result.logprobs.get(item.request_id)
            events.append(RequestOutput(
                item.request_id, (token,), (logprob,) if logprob is not None else None, reason,
            ))
        return events

    # ---- helpers ----------------------------------------------------------------------

    def _admit(self) -> None:
        """FCFS: admit from the head of the queue while the policy's reservation fits."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            reserve = self.policy.reservation(request, self.max_model_len)
            if self.kv_cache.allocate(request.request_id, reserve) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _decodes_then_prefills(self) -> list[Request]:
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            is_decode = request.num_computed_tokens >= request.num_prompt_tokens
            (decodes if is_decode else prefills).append(request)
        return decodes + prefills

    def _tokens_this_iteration(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _new_request_data(self, scheduled: list[ScheduledRequest]) -> list[NewRequestData]:
        new: list[NewRequestData] = []
        for item in scheduled:
            if item.request_id in self._seen_by_runner:
                continue
            self._seen_by_runner.add(item.request_id)
            request = self.requests[item.request_id]
            new.append(NewRequestData(
                request.request_id,
                request.prompt_token_ids + request.output_token_ids,
                request.num_prompt_tokens,
                request.params,
                self.kv_cache.block_ids(request.request_id).copy(),
            ))
        return new

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if token in request.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _end(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_since_schedule.append(request.request_id)

    def _check_invariants(self, output: SchedulerOutput) -> None:
        assert output.num_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs
        held = sum(len(self.kv_cache.block_ids(r.request_id)) for r in self.running)
        assert held == self.kv_cache.num_used_blocks, "KV blocks held by requests that are not running"
