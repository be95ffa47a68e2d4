"""Every NATS subject orca-serve uses, in one place, versioned.

Public (producers use these): GENERATE, GENERATE_HELD, ABORT, JOBS_SUBMIT, jobs_result(id).
Internal subjects carry msgpack-encoded structs from `shared.messages`.
"""

from __future__ import annotations

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
ENGINE_STATUS = f"{PREFIX}.engine.status"  # engine master -> admission: EngineStatus
ADMISSION_STATUS = f"{PREFIX}.admission.status"  # admission -> gateways: AdmissionStatus
TOKENIZER_STATUS = f"{PREFIX}.tokenizer.status"  # tokenizer -> gateways: TokenizerStatus (heartbeat)
METRICS = f"{PREFIX}.metrics"  # every service -> gateways: MetricsSnapshot, once a second
CANCEL = f"{PREFIX}.cancel"  # -> admission + engines: Cancel (abort, or a stop string matched)
TOKENIZER_QUEUE = "tokenizer"
JOBS_QUEUE = "jobs"


def jobs_result(job_id: str) -> str:
    return f"{JOBS_RESULT_PREFIX}.{job_id}"


def engine_admit(replica: str) -> str:
    """admission -> one engine master: Admit."""
    return f"{PREFIX}.engine.{replica}.admit"


def engine_step(replica: str) -> str:
    """engine master -> its workers: StepMessage, one per iteration."""
    return f"{PREFIX}.engine.{replica}.step"


def engine_result(replica: str) -> str:
    """workers -> engine master: StepResult, one per iteration."""
    return f"{PREFIX}.engine.{replica}.result"


def engine_replay(replica: str) -> str:
    """tokenizer -> engine master (request/reply): OutputsReplay."""
    return f"{PREFIX}.engine.{replica}.replay"


def engine_resync(replica: str) -> str:
    """worker -> its engine master: WorkerResync, after a reconnect."""
    return f"{PREFIX}.engine.{replica}.resync"


def placed(tokenizer_instance: str) -> str:
    """admission -> the tokenizer instance that owns the requests: Placed."""
    return f"{PREFIX}.placed.{tokenizer_instance}"


def detok(tokenizer_instance: str) -> str:
    """engine master -> the tokenizer instance that owns the requests: IterationOutputs."""
    return f"{PREFIX}.detok.{tokenizer_instance}"


def is_valid_token(token: str) -> bool:
    """A string usable as one subject token (ids from users end up in subjects)."""
    return bool(token) and len(token) <= 256 and not any(c in token for c in " .*>\t\r\n")
