"""The iteration scheduler: picks every iteration's batch. Pure: no torch, no I/O, no clock.

Two verbs: `schedule()` decides the next iteration; `update(output, result)` applies what
the model produced and returns events. Each iteration is filled by token budget in
Sarathi-Serve's stall-free order: running decodes first, then running prefills (chunks
when chunked prefill is on, each at most `long_prefill_token_threshold` tokens where that is
set), then newly admitted requests. So a prefill and other requests' decodes share one
iteration (selective batching), and one long prompt cannot take a whole iteration's budget.

Admission follows the waiting queue's order (priority, then arrival) and stops at the first
request that does not fit: no skipping, no starvation within a priority. How much KV a
request needs is the policy's call (Orca reserves prompt + max_tokens up front; paged grows
on demand and preempts the lowest-priority, latest-admitted running request when blocks run
out). No new request is admitted in an iteration that had to preempt.

A static policy (`policy.lockstep`, FasterTransformer behind a request-level server) runs a
different loop, `_schedule_lockstep`: its batch is one dense, fixed batch, all of which runs in
every iteration until its longest member ends; finished members keep their lane (and KV) as dead
lanes computing wasted tokens, and every member's output returns when the batch ends.

Several iterations may be in flight at once (pipeline parallelism: one per stage). A request
scheduled in an iteration whose `update` has not come back is in flight: it is left out of
later iterations until then, so it is never in two batches at once (Orca's rule), and it is
never chosen as a preemption victim. With a pipeline of depth D each iteration takes at most
1/D of the active requests, so D batches can be in flight, none of them empty.

Async scheduling (one worker, no pipeline; vLLM V1's name) relaxes Orca's rule by exactly one
step, so the engine can schedule iteration N+1 while the worker runs N: a request whose only
iteration in flight samples its next token may run again in the next iteration, as one decode
whose input is that token. The runner keeps the tokens it samples (it has them first), so the
two iterations depend on each other only inside the worker, which runs them in order. A request
that would end by length at N is not scheduled ahead; one that ends at N by EOS or a stop token
computes one wasted token at N+1, whose result `update` ignores.

A structured-output request waits until its grammar has compiled on the output rank: its grammar is
ordered with the next step (`SchedulerOutput.grammars`), and it is admitted once a result says it is
ready. Requests behind it are admitted meanwhile (a compile never holds up the queue); with nothing
else to run, the scheduler sends a step that only waits for the compile. A constraint the output rank
has compiled before is ready at once (it keeps its compiled grammars; one it has dropped since, it
compiles again when the request arrives there).
"""

from __future__ import annotations

import bisect

import msgspec

from core.batch import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from core.kv_cache import KVCacheManager
from core.policies import AdmissionPolicy, make_policy
from core.request import Request, RequestStatus, queue_key, victim_key
from shared.config import CacheConfig, SchedulerConfig
from shared.outputs import FinishReason, RequestOutput
from shared.structured import StructuredOutputs


MAX_KNOWN_GRAMMARS = 4096
"""Constraints remembered as compiled on the output rank (then forgotten all at once: they compile again)."""


class Scheduler:
    @classmethod
    def from_config(cls, scheduler: SchedulerConfig, cache: CacheConfig, max_model_len: int,
                    pipeline_depth: int = 1, world_size: int = 1) -> Scheduler:
        """The scheduler every engine runs (in process, the engine master, the simulator), with each
        default rule stated once: an iteration's token budget is max(max_model_len, 8192) unless set;
        async scheduling applies where it can (one worker, no pipeline, not a lockstep policy)."""
        policy = make_policy(scheduler.policy)
        return cls(policy, KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching),
                   max_num_seqs=scheduler.max_num_seqs,
                   max_num_batched_tokens=scheduler.max_num_batched_tokens or max(max_model_len, 8192),
                   max_model_len=max_model_len, enable_chunked_prefill=scheduler.enable_chunked_prefill,
                   long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
                   pipeline_depth=pipeline_depth,
                   async_scheduling=(scheduler.async_scheduling and world_size == 1 and pipeline_depth == 1
                                     and not policy.lockstep))

    def __init__(
        self,
        policy: AdmissionPolicy,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = False,
        long_prefill_token_threshold: int = 0,
        pipeline_depth: int = 1,
        async_scheduling: bool = False,
    ) -> None:
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below max_model_len={max_model_len}: "
                "a long prompt could never run; raise it or enable chunked prefill"
            )
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={long_prefill_token_threshold} must be >= 0 (0: no cap)")
        if async_scheduling and (pipeline_depth > 1 or policy.lockstep):
            raise ValueError(f"async scheduling needs one worker with no pipeline and an iteration-level policy "
                             f"(got pipeline depth {pipeline_depth}, policy {policy.name})")
        if policy.lockstep and kv_cache.enable_prefix_caching:
            raise ValueError(f"the {policy.name} policy has no prefix reuse (FasterTransformer had none): "
                             "disable prefix caching")
        self.policy = policy
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        """With chunked prefill: most tokens of one request's chunk in one iteration; 0: no cap."""
        self.pipeline_depth = pipeline_depth
        self.async_scheduling = async_scheduling
        self.waiting: list[Request] = []  # sorted by queue_key
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        """With prefix caching: tokens of the requests admitted to run (a resumed one again), and of those
        the tokens found cached (vLLM's prefix_cache_queries and _hits, counted once per admission)."""
        self.prefix_hit_tokens = 0
        self._iteration = 0
        self._arrivals = 0
        self._admissions = 0
        self._finished_since_schedule: list[str] = []
        self._seen_by_runner: set[str] = set()
        self._in_flight: dict[str, list[tuple[int, bool]]] = {}
        """Requests in iterations not yet updated: (iteration, whether it samples for the request), oldest
        first. A result is applied only to the request instance whose oldest entry it is: a request that
        ended, or was replaced by a newer copy with the same id, while an iteration ran is left alone."""
        self._held: dict[str, list[RequestOutput]] = {}  # lockstep: outputs returned when the batch ends
        self._grammar_orders: dict[str, StructuredOutputs] = {}  # to send with the next step
        self._grammars_compiling: set[str] = set()  # ordered, not yet reported ready
        self._grammar_poll: int | None = None  # the iteration of a step sent only to hear of compiles
        self._compiled_grammars: set[bytes] = set()  # constraints the output rank has compiled (and keeps)

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
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if request.params.max_tokens is None:  # null: until the context, or the cache, is full
            room = min(self.max_model_len, capacity) - request.num_prompt_tokens
            if room < 1:
                raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; the KV cache holds {capacity}, "
                                 "leaving no room to generate")
            request.params = msgspec.structs.replace(request.params, max_tokens=room)
        peak_slots = max(request.peak_tokens(self.max_model_len), self.policy.reservation(request, self.max_model_len))
        if self.kv_cache.blocks_needed(peak_slots) > self.kv_cache.num_blocks:
            raise ValueError(f"request needs {peak_slots} KV slots under the {self.policy.name} policy but the cache "
                             f"holds {capacity}")
        request.arrival_order = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        structured = request.params.structured_outputs
        request.grammar_ready = structured is None or _grammar_key(structured) in self._compiled_grammars
        if not request.grammar_ready:
            self._grammar_orders[request.request_id] = structured
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=queue_key)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> RequestOutput | None:
        """End a request from outside the model (abort, stop string, error); None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._end(request, reason)
        return RequestOutput(request_id, finish_reason=reason, error=error)

    @property
    def iteration(self) -> int:
        """Iterations scheduled so far."""
        return self._iteration

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_in_flight(self) -> int:
        """Requests in iterations scheduled but not yet updated."""
        return len(self._in_flight)

    # ---- the two verbs --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = self._schedule_lockstep() if self.policy.lockstep else self._schedule_iterations()
        if (output.is_empty and (self._grammar_orders or self._grammars_compiling)
                and not self._in_flight and self._grammar_poll is None):
            output = self._emit([], [])  # only grammars to order, or to wait for
            self._grammar_poll = output.iteration
        return output

    def _schedule_iterations(self) -> SchedulerOutput:
        num_running_at_start = len(self.running)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        pending = self._decodes_then_prefills()
        active = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        batch_limit = -(-active // self.pipeline_depth)  # requests in this iteration
        for request in self._schedulable_ahead():
            if len(scheduled) == batch_limit or budget == 0:
                break
            new_blocks = self.kv_cache.allocate(request.request_id, request.num_tokens + 1)
            if new_blocks is not None:  # never preempts for a step ahead: it can wait for its result
                scheduled.append(ScheduledRequest(request.request_id, request.num_tokens, 1, new_blocks, samples=True))
                budget -= 1
        while pending and len(scheduled) < batch_limit:
            request = pending.pop(0)
            num_new = self._tokens_this_iteration(request, budget)
            if num_new == 0:
                continue
            new_blocks = self._grow(request, num_new, pending, preempted)
            if new_blocks is not None:
                scheduled.append(self._scheduled(request, num_new, new_blocks))
                budget -= num_new
        if not preempted and self.policy.admission_open(num_running_at_start):
            for request in self._admit(batch_limit - len(scheduled)):
                num_new = self._tokens_this_iteration(request, budget)
                if num_new:
                    new_blocks = self.kv_cache.allocate(request.request_id, request.num_computed_tokens + num_new)
                    assert new_blocks is not None, "admission reserved less than the first iteration needs"
                    scheduled.append(self._scheduled(request, num_new, new_blocks))
                    budget -= num_new
        if not scheduled:  # nothing runs: the runner hears of these with the next batch
            self._finished_since_schedule.extend(preempted)
            return SchedulerOutput(self._iteration, [], [], [])
        return self._emit(scheduled, preempted)

    def _emit(self, scheduled: list[ScheduledRequest], preempted: list[str],
              dead: list[str] | None = None) -> SchedulerOutput:
        output = SchedulerOutput(
            iteration=self._iteration,
            new_requests=self._new_request_data(scheduled),
            scheduled=scheduled,
            finished_request_ids=self._finished_since_schedule,
            preempted_request_ids=preempted,
            dead_request_ids=dead or [],
            runner_keeps_samples=self.async_scheduling,
            grammars=self._grammar_orders,
            awaiting_grammars=bool(self._grammars_compiling) or bool(self._grammar_orders),
        )
        self._grammars_compiling.update(self._grammar_orders)
        self._grammar_orders = {}
        self._finished_since_schedule = []
        for item in scheduled:
            self._in_flight.setdefault(item.request_id, []).append((output.iteration, item.samples))
        self._iteration += 1
        self._check_invariants(output)
        return output

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        events = self._grammar_news(output, result)
        grammar_done = set(result.grammar_done)
        for item in output.scheduled:
            if not self._applied(item.request_id, output.iteration):
                continue  # ended (or replaced by a newer copy of the same id) while the iteration ran
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # ended (or preempted) while the iteration ran
            request.num_computed_tokens += item.num_new_tokens
            self._register_blocks(request, item.num_new_tokens)
            token = result.sampled_token_ids.get(item.request_id)
            if token is None or request.finish_reason is not None:  # nothing sampled, or a dead lane
                continue
            request.output_token_ids.append(token)
            if output.runner_keeps_samples:
                request.num_tokens_sent = request.num_tokens
            reason = FinishReason.STOP if item.request_id in grammar_done else self._stop_reason(request, token)
            if reason is not None:
                self._retire(request, reason)
            logprob = result.logprobs.get(item.request_id)
            first = len(request.output_token_ids) == 1
            prompt_logprobs = result.prompt_logprobs.get(item.request_id) if first else None
            event = RequestOutput(item.request_id, (token,), (logprob,) if logprob is not None else None, reason,
                                  prompt_logprobs=prompt_logprobs)
            (self._held.setdefault(item.request_id, []) if self.policy.lockstep else events).append(event)
        if self.policy.lockstep and self.running and all(r.finish_reason is not None for r in self.running):
            events += self._end_batch()
        return events

    def _grammar_news(self, output: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Compiles that finished, and requests whose grammar failed (they end with the error)."""
        if output.iteration == self._grammar_poll:
            self._grammar_poll = None
        for request_id in result.grammars_ready:
            self._grammars_compiling.discard(request_id)
            request = self.requests.get(request_id)
            if request is not None:
                request.grammar_ready = True
                if len(self._compiled_grammars) >= MAX_KNOWN_GRAMMARS:
                    self._compiled_grammars.clear()
                self._compiled_grammars.add(_grammar_key(request.params.structured_outputs))
        events = []
        for request_id, error in result.grammar_errors.items():
            self._grammars_compiling.discard(request_id)
            event = self.finish(request_id, FinishReason.ERROR, f"structured output: {error}")
            if event is not None:
                events.append(event)
        return events

    # ---- static (lockstep) batches ------------------------------------------------------

    def _schedule_lockstep(self) -> SchedulerOutput:
        """The whole batch, as one iteration. A new batch's first iteration computes, in every lane,
        as many tokens as its shortest lane knows (FasterTransformer's "as if they all had the same
        input length as the shortest one"); then every lane computes one token per iteration."""
        if self._in_flight:  # a dense batch is one iteration: nothing runs beside it
            return SchedulerOutput(self._iteration, [], [], [])
        if self.policy.admission_open(len(self.running)):
            lanes = self._admit(min(self.max_num_seqs, self.max_num_batched_tokens))
            if not lanes:
                return SchedulerOutput(self._iteration, [], [], [])
            num_new = min(min(r.num_tokens for r in lanes), self.max_num_batched_tokens // len(lanes))
        else:
            lanes, num_new = list(self.running), 1
        scheduled = [self._lane(request, num_new) for request in lanes]
        return self._emit(scheduled, [], [r.request_id for r in lanes if r.finish_reason is not None])

    def _lane(self, request: Request, num_new: int) -> ScheduledRequest:
        """One lane's tokens. A dead lane (its request finished) computes on: its last token, then
        filler (that token again); it never samples."""
        new_blocks = self.kv_cache.allocate(request.request_id, request.num_computed_tokens + num_new)
        assert new_blocks is not None, "a lane outgrew the KV it preallocated"
        item = self._scheduled(request, num_new, new_blocks)
        if request.finish_reason is None:
            return item
        filler = [self._all_tokens(request)[-1]] if request.num_computed_tokens >= request.num_tokens else []
        return ScheduledRequest(request.request_id, item.num_computed_tokens, num_new, new_blocks, samples=False,
                                new_token_ids=item.new_token_ids + filler)

    def _retire(self, request: Request, reason: FinishReason) -> None:
        """A request reached its end: it leaves now, or under a lockstep policy it becomes a dead
        lane that keeps its KV and returns with its batch."""
        if self.policy.lockstep:
            request.finish_reason = reason
        else:
            self._end(request, reason)

    def _end_batch(self) -> list[RequestOutput]:
        """Every lane has finished: all of them return now, and give their KV back."""
        events = []
        for request in list(self.running):
            held = self._held.pop(request.request_id, [])
            logprobs = [lp for e in held for lp in (e.logprobs or ())]
            events.append(RequestOutput(
                request.request_id, tuple(t for e in held for t in e.new_token_ids),
                tuple(logprobs) if logprobs else None, request.finish_reason,
                prompt_logprobs=next((e.prompt_logprobs for e in held if e.prompt_logprobs is not None), None),
            ))
            self._end(request, request.finish_reason)
        return events

    # ---- admission, growth, preemption ---------------------------------------------------

    def _admit(self, limit: int) -> list[Request]:
        """From the head of the waiting queue while the policy's reservation fits."""
        admitted: list[Request] = []
        position = 0  # requests whose grammar is compiling are passed over, not waited for
        while position < len(self.waiting) and len(self.running) < self.max_num_seqs and len(admitted) < limit:
            request = self.waiting[position]
            if not request.grammar_ready:
                position += 1
                continue
            if not self._reserve(request):
                break
            self.waiting.pop(position)
            request.status = RequestStatus.RUNNING
            request.admitted_order = self._admissions
            self._admissions += 1
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _reserve(self, request: Request) -> bool:
        kv = self.kv_cache
        tokens = self._all_tokens(request)
        # prompt logprobs need every prompt position computed: no cached prefix for such a request (vLLM's rule)
        wants_prompt = request.params.prompt_logprobs is not None
        request.num_computed_tokens = (0 if wants_prompt else
                                       kv.share_cached_prefix(request.request_id, tokens, request.cache_salt))
        if kv.allocate(request.request_id, self.policy.reservation(request, self.max_model_len)) is None:
            kv.free(request.request_id)  # give back the shared prefix too
            request.num_computed_tokens = 0
            return False
        if kv.enable_prefix_caching and not wants_prompt:
            self.prefix_queried_tokens += len(tokens)
            self.prefix_hit_tokens += request.num_computed_tokens
        return True

    def _grow(self, request: Request, num_new: int, pending: list[Request],
              preempted: list[str]) -> list[int] | None:
        """Blocks for the request's next tokens; under a growing policy, preempt until they fit.
        Returns None when the request itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache.allocate(request.request_id, request.num_computed_tokens + num_new)
            if new_blocks is not None:
                return new_blocks
            assert self.policy.grows_on_demand, "tokens were scheduled beyond the request's reservation"
            victim = max(pending + [request], key=victim_key)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
            pending.remove(victim)

    def preempt_all(self) -> list[str]:
        """The workers lost every request's KV (one died): all running requests go back to the
        waiting queue with their generated tokens, to resume by recompute."""
        victims = list(self.running)
        self._in_flight.clear()  # the iterations in flight are lost with the KV
        self._grammar_poll = None
        self._compiled_grammars.clear()  # a restarted worker has compiled nothing
        for request_id in self._grammars_compiling:  # the compiles are lost with the worker: order again
            self._grammar_orders[request_id] = self.requests[request_id].params.structured_outputs
        self._grammars_compiling.clear()
        for request in victims:
            self._preempt(request)
        return [r.request_id for r in victims]

    def _preempt(self, request: Request) -> None:
        """By recompute: its KV is freed; it waits again with the tokens it generated."""
        self.kv_cache.free(request.request_id)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=queue_key)
        self._seen_by_runner.discard(request.request_id)
        self.num_preemptions += 1

    # ---- helpers ----------------------------------------------------------------------

    def _applied(self, request_id: str, iteration: int) -> bool:
        """This iteration's result for the request is being applied; False if the iteration is not the
        oldest one in flight for the request instance now holding that id (the one it ran for is gone)."""
        entries = self._in_flight.get(request_id)
        if not entries or entries[0][0] != iteration:
            return False
        entries.pop(0)
        if not entries:
            del self._in_flight[request_id]
        return True

    def _schedulable_ahead(self) -> list[Request]:
        """Under async scheduling: running requests whose one iteration in flight samples their next
        token and cannot end them by length, in admission order. Each can decode that token next."""
        if not self.async_scheduling:
            return []
        ahead = []
        for request in self.running:
            entries = self._in_flight.get(request.request_id)
            if entries is None or len(entries) != 1 or not entries[0][1]:
                continue
            if len(request.output_token_ids) + 1 < request.output_limit(self.max_model_len):
                ahead.append(request)
        return ahead

    def _decodes_then_prefills(self) -> list[Request]:
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            if request.request_id in self._in_flight:
                continue
            is_decode = request.num_computed_tokens >= request.num_tokens - 1 and request.output_token_ids
            (decodes if is_decode else prefills).append(request)
        return decodes + prefills

    def _tokens_this_iteration(self, request: Request, budget: int) -> int:
        """All the tokens the request has left where they fit the budget, else none; with chunked
        prefill, as many as fit, and at most long_prefill_token_threshold (0: no cap)."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        return min(remaining, budget, self.long_prefill_token_threshold or remaining)

    def _scheduled(self, request: Request, num_new: int, new_blocks: list[int]) -> ScheduledRequest:
        new_token_ids: list[int] = []
        if request.request_id in self._seen_by_runner:  # otherwise NewRequestData carries every token
            new_token_ids = request.output_token_ids[request.num_tokens_sent - request.num_prompt_tokens:]
            request.num_tokens_sent = request.num_tokens
        return ScheduledRequest(request.request_id, request.num_computed_tokens, num_new, new_blocks,
                                samples=request.num_computed_tokens + num_new == request.num_tokens,
                                new_token_ids=new_token_ids)

    def _new_request_data(self, scheduled: list[ScheduledRequest]) -> list[NewRequestData]:
        new: list[NewRequestData] = []
        for item in scheduled:
            if item.request_id in self._seen_by_runner:
                continue
            self._seen_by_runner.add(item.request_id)
            request = self.requests[item.request_id]
            request.num_tokens_sent = request.num_tokens
            new.append(NewRequestData(request.request_id, self._all_tokens(request), request.num_prompt_tokens,
                                      request.params, self.kv_cache.block_ids(request.request_id).copy()))
        return new

    def _register_blocks(self, request: Request, num_new: int) -> None:
        kv = self.kv_cache
        if kv.enable_prefix_caching and (request.num_computed_tokens // kv.block_size
                                         > (request.num_computed_tokens - num_new) // kv.block_size):
            kv.register_full_blocks(request.request_id, self._all_tokens(request), request.num_computed_tokens,
                                    request.cache_salt)

    @staticmethod
    def _all_tokens(request: Request) -> list[int]:
        return request.prompt_token_ids + request.output_token_ids

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if token in request.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.output_limit(self.max_model_len):
            return FinishReason.LENGTH
        return None

    def _end(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        self._held.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._in_flight.pop(request.request_id, None)
        self._grammar_orders.pop(request.request_id, None)
        self._grammars_compiling.discard(request.request_id)
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_since_schedule.append(request.request_id)

    def _check_invariants(self, output: SchedulerOutput) -> None:
        assert output.num_tokens <= self.max_num_batched_tokens
        if self.enable_chunked_prefill and self.long_prefill_token_threshold and not self.policy.lockstep:
            assert all(s.num_new_tokens <= self.long_prefill_token_threshold for s in output.scheduled), \
                "a prefill chunk above long_prefill_token_threshold"
        assert len(self.running) <= self.max_num_seqs
        held = {b for r in self.running for b in self.kv_cache.block_ids(r.request_id)}
        assert len(held) == self.kv_cache.num_used_blocks, "KV blocks held by requests that are not running"
        assert not any(self.kv_cache.block_ids(r.request_id) for r in self.waiting), "a waiting request holds KV"
        if self.policy.lockstep:
            assert [s.request_id for s in output.scheduled] == [r.request_id for r in self.running], \
                "a lockstep batch runs every lane, and only its lanes, in every iteration"


def _grammar_key(spec: StructuredOutputs) -> bytes:
    return msgspec.json.encode(spec)
