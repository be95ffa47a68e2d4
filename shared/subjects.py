"""Every NATS subject orca-serve uses, in one place, versioned.

Public (producers use these): GENERATE, GENERATE_HELD, ABORT, JOBS_SUBMIT, jobs_result(id).
Internal subjects carry msgpack-encoded structs from `shared.messages`.
"""

from __future__ import annotations

from collections.abc import Callable

PREFIX = "orca.v1"

# Public API (JSON bodies)
GENERATE = f"{PREFIX}.generate"  # request/stream: events go to the request's reply subject
GENERATE_HELD = f"{PREFIX}.generate.held"  # request {"id"}: the tokenizer holding it answers {"id", "held"}
GENERATE_REPLAY = f"{PREFIX}.generate.replay"  # request {"id", "from_seq"}: the holder sends those events again
ABORT = f"{PREFIX}.abort"  # {"id": ...}
JOBS_SUBMIT = f"{PREFIX}.jobs.submit"  # JetStream work queue, deduplicated by Nats-Msg-Id
JOBS_RESULT_PREFIX = f"{PREFIX}.jobs.result"
JOBS_STREAM = "ORCA_JOBS"
JOBS_RESULTS_STREAM = "ORCA_JOB_RESULTS"
JOBS_CONSUMER = "orca-jobs"

# Internal
ADMISSION_SUBMIT = f"{PREFIX}.admission.submit"  # tokenizer -> admission: TokenizedRequest
ENGINE_STATUS = f"{PREFIX}.engine.status"  # engine master -> admission, tokenizers, gateways: EngineStatus, the
# heartbeat, and at once when the engine's readiness or incarnation changes
ENGINE_PROGRESS = f"{PREFIX}.engine.progress"  # engine master -> admission: EngineStatus between heartbeats
ADMISSION_STATUS = f"{PREFIX}.admission.status"  # admission -> gateways: AdmissionStatus
TOKENIZER_STATUS = f"{PREFIX}.tokenizer.status"  # tokenizer -> gateways: TokenizerStatus (heartbeat)
METRICS = f"{PREFIX}.metrics"  # every service -> gateways: MetricsSnapshot, once a second
CANCEL = f"{PREFIX}.cancel"  # -> admission + engines: Cancel (abort, or a stop string matched)
TOKENIZER_QUEUE = "tokenizer"
JOBS_QUEUE = "jobs"


def jobs_result(job_id: str) -> str:
    return f"{JOBS_RESULT_PREFIX}.{job_id}"


def _engine_subject(kind: str) -> Callable[[str], str]:
    """`orca.v1.engine.<replica>.<kind>`: one engine replica's subject of that kind."""
    return lambda replica: f"{PREFIX}.engine.{replica}.{kind}"


def _instance_subject(kind: str) -> Callable[[str], str]:
    """`orca.v1.<kind>.<instance>`: the subject of one tokenizer instance."""
    return lambda instance: f"{PREFIX}.{kind}.{instance}"


engine_admit = _engine_subject("admit")  # admission -> one engine master: Admit
engine_step = _engine_subject("step")  # engine master -> its workers: StepMessage, one per iteration
engine_result = _engine_subject("result")  # workers -> engine master: StepResult, one per iteration
engine_replay = _engine_subject("replay")  # tokenizer -> engine master (request/reply): OutputsReplay
engine_resync = _engine_subject("resync")  # worker -> its engine master: WorkerResync, after a reconnect
placed = _instance_subject("placed")  # admission -> the tokenizer instance that owns the requests: Placed
detok = _instance_subject("detok")  # engine master -> the tokenizer instance that owns the requests: IterationOutputs


def is_valid_tail(tail: str) -> bool:
    """A string usable as the last tokens of a subject to publish to (a job id names its result's subject):
    dot-separated tokens, none empty, none a wildcard, no whitespace."""
    return (0 < len(tail) <= 256 and not any(c in tail for c in " \t\r\n")
            and all(token not in ("", "*", ">") for token in tail.split(".")))


def is_valid_token(token: str) -> bool:
    """A string usable as one subject token (ids from users end up in subjects)."""
    return bool(token) and len(token) <= 256 and not any(c in token for c in " .*>\t\r\n")
