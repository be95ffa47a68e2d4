"""Where each of a tokenizer's requests is, so that none is lost when what holds it dies.

A tokenizer owns the requests it accepted until their last event: it alone knows every token it
has sent each client. After it hands a request to admission, the request is either queued there
or, once admission says so (`Placed`), held by one engine incarnation. So:

- an engine incarnation that falls silent past the expiry, or is replaced by a new one, has lost
  what it held: those requests *resume* (resubmitted with the tokens already sent; the engine
  continues after them by recompute), up to MAX_RESUMES times;
- an admission with a new incarnation has lost its queue: what was queued there is *resubmitted*
  as it was;
- a submission nobody received (NATS' "no responders": admission is restarting) is resubmitted
  when an admission speaks again;
- what waits on an admission that stays away past `no_admission_timeout_s` is given up (the shell
  ends it with a clear error), so nothing waits forever.

Pure: statuses and the clock in, request ids out; the shell (services/tokenizer/recovery.py) does
the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.liveness import Heartbeats
from shared.messages import STATUS_EXPIRY_S, AdmissionStatus, EngineStatus, Placed, TokenizedRequest


@dataclass
class Tracked:
    tokenized: TokenizedRequest
    """The copy last submitted."""
    engine: tuple[str, str] | None = None
    """(replica, incarnation) that holds it; None while admission does (or nobody yet)."""
    bounced_at: float | None = None
    """When NATS said no admission received it (it waits for an admission to come back)."""
    left: frozenset[tuple[str, str]] = frozenset()
    """Engines it was moved away from: their late outputs belong to a copy that no longer counts."""


@dataclass
class Decisions:
    resume: list[str]
    """Lost with their engine: resubmit with the tokens sent so far."""
    give_up: list[str]
    """No admission for too long: end with an error."""


class Placements:
    def __init__(self, expiry_s: float = STATUS_EXPIRY_S, no_admission_timeout_s: float = 30.0) -> None:
        self.tracked: dict[str, Tracked] = {}
        self.engines = Heartbeats(expiry_s)
        self.no_admission_timeout_s = no_admission_timeout_s
        self.admission: str | None = None
        """The incarnation of the admission last heard from."""
        self.admission_at: float | None = None

    def submitted(self, tokenized: TokenizedRequest) -> None:
        before = self.tracked.get(tokenized.request_id)
        left: frozenset[tuple[str, str]] = frozenset()
        if before is not None:
            left = before.left | ({before.engine} if before.engine is not None else set())
        self.tracked[tokenized.request_id] = Tracked(tokenized, left=left)

    def engine_of(self, request_id: str) -> str | None:
        """`engine_source` of the engine incarnation that holds it, if known."""
        tracked = self.tracked.get(request_id)
        return f"{tracked.engine[0]}/{tracked.engine[1]}" if tracked is not None and tracked.engine else None

    def output_from(self, request_id: str, source: str, copy: int | None = None) -> bool:
        """An engine output for the request arrived from `source`, of its copy `copy` (`resumes` of the
        copy that engine runs; None from an engine that does not say): whether it counts. Only the copy
        last submitted counts, and only from one engine: the one that holds it (where `Placed` said, or,
        if that note was lost, the first heard from), not a second engine running the same copy (a
        submission sent again after a NATS outage that admission placed on another replica). An engine
        the request was moved away from counts again for a newer copy placed there (it was judged gone
        while only NATS was away); without `copy`, an engine it left never counts again."""
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return True
        engine = tuple(source.split("/", 1))
        if len(engine) != 2:
            return False
        if copy is not None and copy != tracked.tokenized.resumes:
            return False  # a late output of a copy that no longer counts
        if copy is None and engine in tracked.left:
            return False
        if tracked.engine is None:
            tracked.engine, tracked.bounced_at = (engine[0], engine[1]), None
        return tracked.engine == engine

    def unplaced(self) -> list[str]:
        """Requests no engine is known to hold: queued in admission, or their `Placed` note was lost."""
        return [r for r, t in self.tracked.items() if t.engine is None]

    def bounced(self, request_id: str, now: float) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is not None:
            tracked.bounced_at = now

    def placed(self, placed: Placed, now: float) -> list[str]:
        """Admission placed these requests; returns those to resume at once: placed on an incarnation this
        tokenizer has seen replaced (the note and the new incarnation's status crossed). An engine it has
        not heard from gets the expiry from now to speak, as if it had: a placement on one that never does
        must resume, not wait for ever. A request whose engine is known already (heard from since it was
        last submitted) stays there: this is a second copy's placement, whose outputs do not count."""
        engine = (placed.replica, placed.incarnation)
        known = self.engines.last.get(placed.replica)
        if known is None:
            self.engines.beat(placed.replica, placed.incarnation, now)
        replaced = known is not None and known[0] != placed.incarnation
        resume = []
        for request_id in placed.request_ids:
            tracked = self.tracked.get(request_id)
            if tracked is None or tracked.engine not in (None, engine):
                continue
            if replaced:
                resume.append(request_id)
            else:
                tracked.engine, tracked.bounced_at = engine, None
        return resume

    def keep_only(self, active: set[str] | dict) -> None:
        """Forget the requests that have ended (the shell does not report each end)."""
        for request_id in [r for r in self.tracked if r not in active]:
            del self.tracked[request_id]

    def on_engine_status(self, status: EngineStatus, now: float) -> list[str]:
        """Requests to resume: those held by the incarnation this status replaces."""
        replaced = self.engines.beat(status.replica, status.incarnation, now)
        return self._held_by(status.replica, replaced) if replaced is not None else []

    def on_admission_status(self, status: AdmissionStatus, now: float) -> list[str]:
        """Requests to resubmit: those queued with the admission this one replaces, and those no
        admission received."""
        restarted = self.admission is not None and status.incarnation != self.admission
        self.admission, self.admission_at = status.incarnation, now
        return [r for r, t in self.tracked.items()
                if t.bounced_at is not None or (restarted and t.engine is None)]

    def on_reconnected(self, now: float) -> None:
        """This observer's NATS connection is back: the statuses it missed say nothing of the others. Every
        clock starts again from now (`tick` was not called while the connection was away)."""
        self.engines.restart_clocks(now)
        if self.admission_at is not None:
            self.admission_at = now

    def tick(self, now: float) -> Decisions:
        """Engines silent past the expiry; requests that have waited too long for an admission."""
        resume = [r for replica, incarnation in self.engines.expire(now) for r in self._held_by(replica, incarnation)]
        return Decisions(resume, [r for r, t in self.tracked.items() if self._waited_too_long(t, now)])

    def _waited_too_long(self, tracked: Tracked, now: float) -> bool:
        if tracked.engine is not None:
            return False
        if tracked.bounced_at is not None:
            return now - tracked.bounced_at > self.no_admission_timeout_s
        return self.admission_at is not None and now - self.admission_at > self.no_admission_timeout_s

    def _held_by(self, replica: str, incarnation: str) -> list[str]:
        return [r for r, t in self.tracked.items() if t.engine == (replica, incarnation)]
