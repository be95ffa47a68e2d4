"""The in-process engine: the Orca loop with no NATS and no Ray.

`step()` reads like the algorithm: schedule, execute, update, publish. The same scheduler
and runner run behind NATS and Ray in `services/`; this is what `orca generate`, the
tests and the benchmarks' baseline loop use. With pipeline parallelism the executor holds
one iteration per stage in flight, each with different requests (`step()` keeps the
pipeline full, then applies the oldest iteration's result).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from core.batch import SchedulerOutput
from core.detokenize import IncrementalDetokenizer
from core.request import Request
from core.scheduler import Scheduler
from engine.executor import Executor, LocalExecutor, MultiprocExecutor, RunnerArgs
from engine.tokenizer import Tokenizer, load_tokenizer, render_messages
from model.arch import check_split, eos_token_ids, load_arch_config, resolve_max_model_len
from model.runner import ModelRunner
from shared.api import GenerateRequest
from shared.config import EngineConfig
from shared.outputs import FinishReason, RequestOutput, TokenLogprob
from shared.sampling import SamplingParams


@dataclass
class Completion:
    """Everything known about a request, updated as its tokens come."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    """With prompt_logprobs asked for: one per prompt token after the first, once its first token came."""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it (vLLM's `stop_reason`); None for any other end."""
    error: str | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def metrics(self) -> dict[str, float | None]:
        def since_arrival(t: float | None) -> float | None:
            return None if t is None else round(t - self.arrival_time, 6)
        return {"queue_s": since_arrival(self.first_scheduled_time), "ttft_s": since_arrival(self.first_token_time),
                "latency_s": since_arrival(self.finished_time)}


@dataclass
class Delta:
    """What one step added to one request."""

    completion: Completion
    new_token_ids: tuple[int, ...]
    new_text: str

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 tokenizer: Tokenizer | None = None, max_batches_in_flight: int | None = None,
                 stream_text: bool = True) -> None:
        """`max_batches_in_flight`: default one per pipeline stage; 1 runs the stages in turn
        (benchmarks compare the two). `stream_text=False` (a batch job that wants only whole texts):
        a request without stop strings is detokenized once when it finishes, not at every step."""
        self.config = config
        self.max_model_len = resolve_max_model_len(config.model.model, config.model.max_model_len)
        cache = config.cache
        arch = load_arch_config(config.model.model)
        check_split(arch, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size)
        self.executor: Executor
        if config.parallel.world_size > 1:
            self.executor = MultiprocExecutor(config, self.max_model_len)
        else:
            self.executor = LocalExecutor(runner or RunnerArgs(config, self.max_model_len).build())
        self.tokenizer = tokenizer or load_tokenizer(config.model.model)
        self.vocab_size = arch.vocab_size
        self.max_batches_in_flight = max_batches_in_flight or self.executor.depth
        self.eos_token_ids = (self.tokenizer.eos_token_ids if self.tokenizer is not None
                              else eos_token_ids(config.model.model))
        self.scheduler = Scheduler.from_config(config.scheduler, cache, self.max_model_len,
                                               pipeline_depth=self.max_batches_in_flight,
                                               world_size=config.parallel.world_size)
        self.kv_cache = self.scheduler.kv_cache
        self.completions: dict[str, Completion] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.iterations: list[SchedulerOutput] = []
        self.in_flight_log: list[tuple[int, ...]] = []
        """With record_iterations: after each submit, the iterations in flight (oldest first)."""
        self.record_iterations = False
        self.stream_text = stream_text
        self._in_flight: deque[SchedulerOutput] = deque()

    # ---- requests --------------------------------------------------------------------

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """Token ids of a request's prompt, its chat messages, or the ids it gave."""
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: send prompt_token_ids instead")
        if request.messages is not None:
            return render_messages(self.tokenizer, request, self.config.model.chat_template)
        return self.tokenizer.encode(request.prompt or "")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> Completion:
        """Validate and queue; raises ValueError with the reason if the request cannot be served."""
        params = params.validate()
        params.check_vocabulary(self.vocab_size)
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority=priority,
                          cache_salt=cache_salt)
        self.scheduler.add_request(request)
        completion = Completion(request_id, list(prompt_token_ids), arrival_time=time.perf_counter(),
                                logprobs=[] if params.logprobs is not None else None)
        self.completions[request_id] = completion
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer.of(self.tokenizer.decode, params,
                                                                       self.eos_token_ids)
        return completion

    def abort(self, request_id: str) -> Delta | None:
        event = self.scheduler.abort(request_id)
        return self._apply(event, time.perf_counter()) if event else None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._in_flight)

    @property
    def runner(self) -> ModelRunner:
        assert isinstance(self.executor, LocalExecutor), "the runner lives in worker processes"
        return self.executor.runner

    def close(self) -> None:
        """Stop the worker processes (if any)."""
        self.executor.close()

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[Delta]:
        while len(self._in_flight) < self.max_batches_in_flight:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                break
            now = time.perf_counter()
            for item in scheduler_output.new_requests:
                completion = self.completions[item.request_id]
                completion.first_scheduled_time = completion.first_scheduled_time or now
            self.executor.submit(scheduler_output)
            self._in_flight.append(scheduler_output)
            if self.record_iterations:
                self.iterations.append(scheduler_output)
                self.in_flight_log.append(tuple(s.iteration for s in self._in_flight))
        if not self._in_flight:
            return []
        scheduler_output = self._in_flight.popleft()
        events = self.scheduler.update(scheduler_output, self.executor.collect())
        now = time.perf_counter()
        return [self._apply(event, now) for event in events]

    def _apply(self, event: RequestOutput, now: float) -> Delta:
        completion = self.completions[event.request_id]
        reason = event.finish_reason
        detok = self._detokenizers.get(event.request_id)
        new_tokens = event.new_token_ids
        new_text = ""
        engine_stopped = reason is FinishReason.STOP
        if detok is not None and detok.watches_stop_strings:
            new_text, taken = detok.add_output(new_tokens, engine_stopped)
            new_tokens = new_tokens[:taken]
            if detok.stopped and reason in (None, FinishReason.LENGTH):  # the text ends at the stop string
                if reason is None:
                    self.scheduler.finish(event.request_id, FinishReason.STOP)
                reason = FinishReason.STOP
        completion.token_ids.extend(new_tokens)
        if new_tokens and completion.first_token_time is None:
            completion.first_token_time = now
        if completion.logprobs is not None and event.logprobs:
            completion.logprobs.extend(event.logprobs[:len(new_tokens)])
        if event.prompt_logprobs is not None:
            completion.prompt_logprobs = list(event.prompt_logprobs)
        if detok is not None and (detok.watches_stop_strings or self.stream_text or reason is not None):
            if not detok.watches_stop_strings:
                # Unstreamed, a request without stop strings is decoded once, from all its tokens.
                new_text = detok.add_output(new_tokens if self.stream_text else completion.token_ids, engine_stopped)[0]
            if reason is not None:
                new_text += detok.flush()
            completion.text = detok.text if reason is not None else completion.text + new_text
        if reason is not None:
            completion.finish_reason, completion.error = reason, event.error
            if reason is FinishReason.STOP and detok is not None:
                completion.stop_reason = detok.stop_reason
            completion.finished_time = now
            self.completions.pop(event.request_id)
            self._detokenizers.pop(event.request_id, None)
        return Delta(completion, new_tokens, new_text)
