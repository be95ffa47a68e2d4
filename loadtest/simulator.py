"""A discrete-event simulator: the REAL iteration scheduler, with the model replaced by a cost model.

Every iteration runs `core.scheduler.Scheduler.schedule()` (the same policies and
`KVCacheManager` the engine uses), asks the cost model how long that batch takes, advances
the simulated clock by it, and feeds `Scheduler.update()` a made-up token for every request
that samples. Requests ignore EOS, so each generates exactly its `max_tokens`. Under the static
policy a batch is one pipeline micro-batch and its dead lanes are charged like decodes. Arrivals are
added between iterations by the same stepped driver that runs the in-process engine
(`loadtest.loadgen.drive_stepped`), on the simulated clock. Nothing reads the wall clock or an
unseeded random source, so a seed fixes the result.
"""

from __future__ import annotations

from typing import Protocol

from loadtest.cost_models import IterationShape, iteration_shapes
from loadtest.loadgen import RunResult, StepEvent, drive_stepped
from core.batch import RunnerOutput
from core.request import Request
from core.scheduler import Scheduler
from shared.api import GenerateRequest
from shared.config import CacheConfig, SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams

SIMULATED_TOKEN = 0


class CostModel(Protocol):
    """What the simulator needs of a cost model (see loadtest.cost_models)."""

    max_model_len: int
    default_kv_cache_tokens: int

    def iteration_time(self, shapes: list[IterationShape], pipelined: bool = True) -> float: ...


class SimulatedEngine:
    """A stepped target (`loadtest.loadgen.SteppedTarget`) on a simulated clock, with the engine's own
    scheduler and KV cache configs; None takes the cost model's: its KV capacity (what fits next to
    the weights, in blocks of the default size) and its context length."""

    def __init__(self, scheduler: SchedulerConfig, cost_model: CostModel, cache: CacheConfig | None = None,
                 max_model_len: int | None = None) -> None:
        self.cost_model = cost_model
        self.max_model_len = max_model_len or cost_model.max_model_len
        cache = cache or CacheConfig(kv_cache_tokens=cost_model.default_kv_cache_tokens)
        self.scheduler = Scheduler.from_config(scheduler, cache, self.max_model_len)
        self.now = 0.0
        self.iterations = 0
        self.busy_s = 0.0
        self._prompt_lens: dict[str, int] = {}

    # ---- the stepped-target interface ---------------------------------------------------

    def add(self, request: GenerateRequest) -> int:
        if request.prompt_token_ids is None:
            raise ValueError(f"request {request.id!r}: the simulator needs prompt_token_ids (or use --trace)")
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.add_request(Request(request.id, list(request.prompt_token_ids), params))
        self._prompt_lens[request.id] = len(request.prompt_token_ids)
        return len(request.prompt_token_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[StepEvent]:
        output = self.scheduler.schedule()
        if output.is_empty:
            raise RuntimeError(f"the scheduler scheduled nothing with {len(self.scheduler.requests)} requests "
                               "unfinished: they can never run with this configuration")
        duration = self.cost_model.iteration_time(iteration_shapes(output, self._prompt_lens),
                                                  pipelined=not self.scheduler.policy.lockstep)
        self.now += duration
        self.busy_s += duration
        self.iterations += 1
        sampled = {item.request_id: SIMULATED_TOKEN for item in output.scheduled if item.samples}
        events = []
        for event in self.scheduler.update(output, RunnerOutput(sampled_token_ids=sampled)):
            finished = event.finish_reason is not None
            error = None if event.finish_reason in (None, FinishReason.LENGTH, FinishReason.STOP) else event.error
            events.append(StepEvent(event.request_id, len(event.new_token_ids), finished, error))
            if finished:
                del self._prompt_lens[event.request_id]
        return events

    # ---- the simulated clock ------------------------------------------------------------

    def clock(self) -> float:
        return self.now

    def sleep_until(self, t: float) -> None:
        self.now = max(self.now, t)


def simulate(requests: list[GenerateRequest], arrivals: list[float], scheduler: SchedulerConfig,
             cost_model: CostModel, *, cache: CacheConfig | None = None, max_model_len: int | None = None,
             max_concurrency: int | None = None, progress: bool = False, desc: str = "") -> RunResult:
    """Replay the workload; returns the same records `orca bench` measures, on simulated time.
    `cache` and `max_model_len`: None takes the cost model's (see SimulatedEngine)."""
    engine = SimulatedEngine(scheduler, cost_model, cache, max_model_len)
    result = drive_stepped(engine, requests, arrivals, max_concurrency=max_concurrency, clock=engine.clock,
                           sleep_until=engine.sleep_until, desc=desc, progress=progress)
    assert engine.scheduler.kv_cache.num_used_blocks == 0, "KV blocks still held after every request ended"
    return result
