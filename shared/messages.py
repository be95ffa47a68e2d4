"""Internal control messages (msgpack on NATS). Subjects are in `shared.subjects`.

The step and result messages of the engine loop live beside the scheduler
(`core.batch.SchedulerOutput` and `core.batch.StepResult`): one each per iteration, not one per token.
"""

from __future__ import annotations

import msgspec

from shared.outputs import FinishReason, RequestOutput
from shared.sampling import SamplingParams

# ---- liveness: every long-lived service says it is alive; silence past the expiry means gone ----

HEARTBEAT_S = 0.5
"""An engine master publishes its status at least this often (more often while it works), a
tokenizer its TokenizerStatus twice as seldom. A status is a heartbeat."""
STATUS_EXPIRY_S = 3.0
"""A service whose last status is older than this is gone (dead, or hung: a SIGSTOPped process is
alive and silent): admission stops routing to such an engine, /health stops counting it, and
tokenizers resume the requests it held. Six missed engine heartbeats, so load jitter is no death."""
MAX_RESUMES = 2
"""A request resumes by recompute at most this many times after losing its engine (a worker or
the master died); one more loss ends it with an error, so a request that kills engines cannot
take every replica down in turn."""


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
    trace_context: str | None = None
    """W3C traceparent of the request's span: admission and engines parent or link their spans to it
    (an Admit carries many requests, so NATS headers cannot carry it)."""
    resume_token_ids: list[int] = []
    """Tokens already generated and sent to the client, when the request resumes after the engine
    that held it (or the tokenizer that owned it) was lost: the engine continues after them, by
    recompute, and never sends them again."""
    resumes: int = 0
    """Times this request has resumed after losing its engine (see MAX_RESUMES)."""
    cache_salt: str | None = None
    """vLLM's: with prefix caching, it reuses only prefixes cached by requests with the same salt."""


class Admit(msgspec.Struct, frozen=True):
    """admission -> one engine master: requests it reported room for."""

    sequence: int
    """Increases by one per Admit to an engine; the engine echoes the last one it applied."""
    requests: list[TokenizedRequest]
    incarnation: str = ""
    """The engine incarnation it is for: one sent again after that master restarted is dropped (the
    new incarnation numbers its admits from 0 again; the requests resume through their tokenizers)."""


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
    """Admitted requests the engine holds but does not run yet (waiting for KV or a batch slot)."""
    max_num_seqs: int
    max_model_len: int
    last_admit_sequence: int
    """The last Admit it applied: admission counts the ones after it as still in flight."""
    iteration: int
    kv_used_blocks: int
    """Blocks some request holds (cached blocks no request holds count as free)."""
    num_preemptions: int = 0
    """Requests sent back to wait (KV ran out, or a worker died and they resume by recompute)."""
    steps: int = 0
    """Iterations run since start; with the two sums below they give the per-iteration cost."""
    step_seconds: float = 0.0
    """Sum of iteration wall times (schedule, step message, worker, result, update, publish)."""
    execute_seconds: float = 0.0
    """Sum of the workers' time in the model runner; the difference is control overhead."""
    pipeline_depth: int = 1
    """Iterations the engine may keep in flight (its pipeline stages)."""
    max_batches_in_flight: int = 0
    """The most iterations it has had in flight at once since it started."""


class Cancel(msgspec.Struct, frozen=True):
    """End a request wherever it is: an abort, or a stop string the tokenizer matched."""

    request_id: str
    reason: FinishReason


class IterationOutputs(msgspec.Struct, frozen=True, array_like=True):
    """engine master (or admission, for requests it ends) -> one tokenizer instance."""

    outputs: list[RequestOutput]
    source: str = ""
    """`engine_source(replica, incarnation)` of the engine that sent them ("" from admission)."""
    seq: int = -1
    """From an engine: this message's number in the stream from that source to that tokenizer (0, 1,
    2, ...). A tokenizer that sees a gap, or reconnects to NATS, asks for the rest (`OutputsReplay`);
    -1 from admission, whose rare messages are not numbered."""
    copies: list[int] = []
    """From an engine: for each output, the copy of its request it comes from (`TokenizedRequest.resumes`
    of the copy admitted). A request resumed onto the engine that held it before (one its tokenizer
    judged gone while NATS was away) then still counts its new copy's outputs, never the old one's.
    Empty from admission."""


class OutputsReplay(msgspec.Struct, frozen=True):
    """tokenizer -> one engine master (request/reply): send again the messages of the stream to
    `owner` from `from_seq` on; they go to the owner's detok subject as before, then this is answered."""

    owner: str
    incarnation: str
    """The engine incarnation the owner heard from: another one has nothing of that stream."""
    from_seq: int


class OutputsReplayed(msgspec.Struct, frozen=True):
    """The answer to an OutputsReplay: `ok` False when the messages asked for are no longer kept
    (older than the replay window) or the incarnation is gone."""

    ok: bool
    next_seq: int = 0


class WorkerResync(msgspec.Struct, frozen=True):
    """worker -> its engine master, after the worker reconnected to NATS (step messages sent while it
    was away may be lost): the last iteration it ran; the master sends the iterations in flight again."""

    rank: int
    last_iteration: int


def engine_source(replica: str, incarnation: str) -> str:
    """One engine master's life: a restarted master (or one that lost its requests) is a new source."""
    return f"{replica}/{incarnation}"


class Placed(msgspec.Struct, frozen=True):
    """admission -> the owning tokenizer instance, as it admits: which engine now holds these
    requests. Until then admission holds them (and a new admission incarnation has lost them)."""

    replica: str
    incarnation: str
    request_ids: list[str]


class TokenizerStatus(msgspec.Struct, frozen=True):
    """tokenizer -> gateways (for /health), every 2 x HEARTBEAT_S."""

    instance: str
    num_active: int
    draining: bool = False


class AdmissionStatus(msgspec.Struct, frozen=True):
    """admission -> anyone (gateways shed load with it): the global queue's length and bound."""

    queue_len: int
    """Requests waiting in the global queue."""
    max_queue_len: int
    """Its bound: at `queue_len >= max_queue_len` new requests are refused at once."""
    num_engines_ready: int
    """Engine replicas admission heard a ready status from in the last STATUS_EXPIRY_S."""
    incarnation: str = ""
    """Changes when admission restarts: tokenizers then resubmit what they had queued with it."""

    @property
    def full(self) -> bool:
        return self.queue_len >= self.max_queue_len


# ---- metric snapshots: every service -> subjects.METRICS -> gateways (summed per source) ----------

class HistogramData(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Cumulative counts per bucket (the bounds are constants in `shared.telemetry`; the last
    bucket is +Inf) and the sum of observed values."""

    counts: list[int]
    sum: float


class RequestSizes(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """vLLM's request-level token histograms: one sample per request that ended after its first token (their
    sums are the prompt and generation counters' shares)."""

    prompt_tokens: HistogramData
    generation_tokens: HistogramData
    max_tokens: HistogramData
    """Of those that gave a max_tokens."""


class RequestPhases(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """vLLM's request phases: one sample per request that ended in this engine after its first token."""

    prefill: HistogramData
    """First scheduled to first token."""
    decode: HistogramData
    """First token to last token."""
    inference: HistogramData
    """First scheduled to last token."""
    time_per_output_token: HistogramData
    """Decode time over the tokens after the first (requests of more than one token)."""


class TokenizerMetrics(msgspec.Struct, frozen=True, tag="tokenizer"):
    """Per request, measured where requests arrive and end (the tokenizer sees both)."""

    source: str
    """One id per process start."""
    prompt_tokens: int
    generation_tokens: int
    finished: dict[FinishReason, int]
    time_to_first_token: HistogramData
    inter_token_latency: HistogramData
    e2e_request_latency: HistogramData
    num_active: int
    """Requests this instance accepted that have not ended."""
    request_sizes: RequestSizes | None = None
    """None from a process of a version before them."""


class AdmissionMetrics(msgspec.Struct, frozen=True, tag="admission"):
    source: str
    queue_len: int
    max_queue_len: int
    admitted: int
    rejected_queue_full: int
    rejected_unservable: int


class EngineMetrics(msgspec.Struct, frozen=True, tag="engine"):
    """One engine replica's iteration loop. Counters are cumulative since the process started."""

    source: str
    replica: str
    policy: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    kv_used_blocks: int
    kv_reserved_slots: int
    """Slots in blocks held by running requests (Orca reserves prompt + max_tokens up front)."""
    kv_used_slots: int
    """Slots holding computed tokens; reserved minus used is the reservation's waste."""
    num_preemptions: int
    """Requests sent back to wait (their KV freed) to make room."""
    iterations: int
    request_queue_time: HistogramData
    """Arrival (at a tokenizer) to first scheduled here, once per request."""
    iteration_tokens: HistogramData
    batch_size: HistogramData
    """Requests per iteration."""
    request_phases: RequestPhases | None = None
    """None from a process of a version before them."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache (with prefix caching on)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""


MetricsSnapshot = TokenizerMetrics | AdmissionMetrics | EngineMetrics
