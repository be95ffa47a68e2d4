"""Internal control messages (msgpack on NATS). Subjects are in `shared.subjects`.

The step and result messages of the engine loop live beside the scheduler
(`core.batch.SchedulerOutput` and `core.batch.StepResult`): one each per iteration, not one per token.
"""

from __future__ import annotations

import msgspec

from shared.outputs import FinishReason, RequestOutput
from shared.sampling import SamplingParams


class TokenizedRequest(msgspec.Struct, frozen=True):
    """tokenizer -> admission -> engine master."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer_instance: str
    """Where the engine sends this request's outputs to be detokenized."""
    arrival_time: float
    """Unix time the system accepted the request."""
    priority: int = 0


class Admit(msgspec.Struct, frozen=True):
    """admission -> one engine master: requests it reported room for."""

    sequence: int
    """Increases by one per Admit to an engine; the engine echoes the last one it applied."""
    requests: list[TokenizedRequest]


class EngineStatus(msgspec.Struct, frozen=True):
    """engine master -> admission, after every iteration and every Admit. The engine's KV
    manager is the source of truth: admission decides from these figures alone."""

    replica: str
    incarnation: str
    """Changes when the engine master restarts (its admit sequence starts again at 0)."""
    ready: bool
    block_size: int
    num_blocks: int
    admissible_blocks: int
    """Free blocks minus those its own waiting requests will reserve."""
    num_running: int
    num_waiting: int
    max_num_seqs: int
    max_model_len: int
    last_admit_sequence: int
    iteration: int
    kv_used_blocks: int
    num_preemptions: int = 0
    """Requests sent back to wait (KV ran out, or a worker died and they resume by recompute)."""
    steps: int = 0
    """Iterations run since start; with the two sums below they give the per-iteration cost."""
    step_seconds: float = 0.0
    """Sum of iteration wall times (schedule, step message, worker, result, update, publish)."""
    execute_seconds: float = 0.0
    """Sum of the workers' time in the model runner; the difference is control overhead."""


class Cancel(msgspec.Struct, frozen=True):
    """End a request wherever it is: an abort, or a stop string the tokenizer matched."""

    request_id: str
    reason: FinishReason


class IterationOutputs(msgspec.Struct, frozen=True, array_like=True):
    """engine master (or admission, for requests it ends) -> one tokenizer instance."""

    outputs: list[RequestOutput]


class WorkerReady(msgspec.Struct, frozen=True):
    """worker -> engine master when it has loaded its shard (also after a restart)."""

    rank: int
    incarnation: str


class AdmissionStatus(msgspec.Struct, frozen=True):
    """admission -> anyone (gateways shed load with it): the global queue's length and bound."""

    queue_len: int
    max_queue_len: int
    num_engines_ready: int

    @property
    def full(self) -> bool:
        return self.queue_len >= self.max_queue_len
