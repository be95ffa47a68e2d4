"""What the gateway knows of the rest of the system, for /health, back-pressure and the context
length: the latest admission status and each engine's and tokenizer's latest status, with when
each came. Every one of them is a heartbeat: a status older than STATUS_EXPIRY_S is not believed,
so a service that died or hangs stops counting within that bound, and counts again with its
first status once it is back.
"""

from __future__ import annotations

import time

from shared.messages import STATUS_EXPIRY_S, AdmissionStatus, EngineStatus, TokenizerStatus


class StatusBoard:
    def __init__(self, expiry_s: float = STATUS_EXPIRY_S) -> None:
        self.expiry_s = expiry_s
        self.admission: AdmissionStatus | None = None
        self.admission_at = 0.0
        self.engines: dict[str, tuple[EngineStatus, float]] = {}
        self.tokenizers: dict[str, tuple[TokenizerStatus, float]] = {}

    def on_admission(self, status: AdmissionStatus) -> None:
        self.admission, self.admission_at = status, time.monotonic()

    def on_engine(self, status: EngineStatus) -> None:
        self.engines[status.replica] = (status, time.monotonic())

    def on_tokenizer(self, status: TokenizerStatus) -> None:
        self.tokenizers[status.instance] = (status, time.monotonic())

    def fresh_admission(self) -> AdmissionStatus | None:
        if self.admission is not None and time.monotonic() - self.admission_at < self.expiry_s:
            return self.admission
        return None

    def ready_engines(self) -> list[EngineStatus]:
        now = time.monotonic()
        return [s for s, at in self.engines.values() if s.ready and now - at < self.expiry_s]

    def live_tokenizers(self) -> list[TokenizerStatus]:
        now = time.monotonic()
        return [s for s, at in self.tokenizers.values() if not s.draining and now - at < self.expiry_s]

    @property
    def num_engines_ready(self) -> int:
        """Engines both admission and this gateway hear from: the fewer of the two counts."""
        admission = self.fresh_admission()
        return min(admission.num_engines_ready, len(self.ready_engines())) if admission is not None else 0

    def unavailable(self) -> str | None:
        """Why a request sent now could not be served, or None: admission, a ready engine and a
        tokenizer must all be alive."""
        if self.fresh_admission() is None:
            return "the admission service is not answering"
        if self.num_engines_ready == 0:
            return "no engine is ready"
        if not self.live_tokenizers():
            return "no tokenizer service is answering"
        return None

    @property
    def healthy(self) -> bool:
        return self.unavailable() is None

    @property
    def queue_full(self) -> bool:
        admission = self.fresh_admission()
        return admission is not None and admission.full

    def max_model_len(self) -> int | None:
        """The longest context a ready engine serves (admission sends a request to any that fits): its
        max_model_len, or its whole KV cache where that holds fewer tokens (no request outgrows the cache)."""
        return max((min(s.max_model_len, s.num_blocks * s.block_size) for s in self.ready_engines()), default=None)

    def kv_capacity_tokens(self) -> int | None:
        return max((s.num_blocks * s.block_size for s in self.ready_engines()), default=None)

    def health(self) -> tuple[int, dict]:
        """/health's status code and body: 200 while a request could be served, else 503 and why."""
        admission = self.fresh_admission()
        why = self.unavailable()
        body = {"status": "ok" if why is None else "unavailable", "num_engines_ready": self.num_engines_ready,
                "num_tokenizers": len(self.live_tokenizers()),
                "queue_len": admission.queue_len if admission else None,
                "max_queue_len": admission.max_queue_len if admission else None}
        if why is not None:
            body["reason"] = why
        return (200 if why is None else 503), body
