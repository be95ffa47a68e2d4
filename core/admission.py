"""The admission scheduler's core: one global FCFS queue, engines' reported room, decisions.

Pure: status messages in, `(engine, requests)` decisions out. It keeps no KV ledger of its
own: an engine's room is what that engine last reported, and after an Admit the engine is
not offered more until a status echoes that Admit (so a report is never counted twice).

Statuses are also heartbeats (`core.liveness`): an engine silent past the expiry, or replaced by a
new incarnation, is dropped at once and offered nothing more; the tokenizers that own its requests
resume them. Requests that wait while no engine at all is alive end after `no_engine_timeout_s`,
so that nothing waits forever.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from core.liveness import Heartbeats
from shared.messages import STATUS_EXPIRY_S, EngineStatus, TokenizedRequest


class QueueFull(Exception):
    pass


@dataclass
class EngineView:
    status: EngineStatus
    sent_sequence: int = 0
    unacked: dict[int, tuple[float, list[TokenizedRequest]]] = field(default_factory=dict)
    """Admits sent and not yet acknowledged by a status: sequence -> (when last sent, requests)."""

    @property
    def acknowledged(self) -> bool:
        return self.status.last_admit_sequence >= self.sent_sequence


def reservation_blocks(request: TokenizedRequest, status: EngineStatus) -> int:
    prompt_len = len(request.prompt_token_ids)
    if request.params.max_tokens is None:  # null: until the context, or the engine's cache, is full
        slots = min(status.max_model_len, status.num_blocks * status.block_size)
    else:
        slots = min(prompt_len + request.params.output_limit(prompt_len, status.max_model_len), status.max_model_len)
    return -(-slots // status.block_size)


class AdmissionQueue:
    def __init__(self, max_queue_len: int, expiry_s: float = STATUS_EXPIRY_S,
                 no_engine_timeout_s: float = 60.0) -> None:
        self.max_queue_len = max_queue_len
        self.queue: OrderedDict[str, TokenizedRequest] = OrderedDict()
        self.engines: dict[str, EngineView] = {}
        self.heartbeats = Heartbeats(expiry_s)
        self.no_engine_timeout_s = no_engine_timeout_s
        self._no_engine_since: float | None = None

    def submit(self, request: TokenizedRequest) -> None:
        if request.request_id in self.queue:
            # Its tokenizer sent it again (it saw a new admission incarnation, or resumes it): the
            # newer copy knows more (tokens already generated); it keeps the older one's place.
            self.queue[request.request_id] = request
            return
        if len(self.queue) >= self.max_queue_len:
            raise QueueFull(f"the admission queue is full ({self.max_queue_len} requests); retry later")
        self.queue[request.request_id] = request
        if request.priority != 0 and any(r.priority > request.priority for r in self.queue.values()):
            # keep the queue ordered by (priority, arrival); the sort is stable, so FCFS within a priority
            ordered = sorted(self.queue.values(), key=lambda r: r.priority)
            self.queue = OrderedDict((r.request_id, r) for r in ordered)

    def remove(self, request_id: str) -> TokenizedRequest | None:
        return self.queue.pop(request_id, None)

    def on_status(self, status: EngineStatus, now: float = 0.0) -> None:
        self.heartbeats.beat(status.replica, status.incarnation, now)
        view = self.engines.get(status.replica)
        if view is None or view.status.incarnation != status.incarnation:
            self.engines[status.replica] = EngineView(status, status.last_admit_sequence)
        else:
            view.status = status
            for sequence in [s for s in view.unacked if s <= status.last_admit_sequence]:
                del view.unacked[sequence]

    def forget_engine(self, replica: str) -> None:
        self.engines.pop(replica, None)
        self.heartbeats.forget(replica)

    def expire(self, now: float) -> list[str]:
        """Drop the engines silent past the expiry (dead or hung); returns their replica names."""
        gone = [replica for replica, _ in self.heartbeats.expire(now)]
        for replica in gone:
            self.engines.pop(replica, None)
        return gone

    def starved(self, now: float) -> list[TokenizedRequest]:
        """Remove and return every queued request once no engine has been alive for
        `no_engine_timeout_s` (an engine that restarts comes back well within it)."""
        if self.engines or not self.queue:
            self._no_engine_since = None
            return []
        if self._no_engine_since is None:
            self._no_engine_since = now
        if now - self._no_engine_since < self.no_engine_timeout_s:
            return []
        starved = list(self.queue.values())
        self.queue.clear()
        return starved

    def decide(self, now: float = 0.0) -> list[tuple[str, int, list[TokenizedRequest]]]:
        """Admit from the head of the queue, FCFS, while some engine reported room; returns
        (replica, admit sequence, requests) per engine offered work."""
        room = {name: (v.status.admissible_blocks, v.status.max_num_seqs - v.status.num_running - v.status.num_waiting)
                for name, v in self.engines.items() if v.status.ready and v.acknowledged}
        batches: dict[str, list[TokenizedRequest]] = {}
        while self.queue:
            request = next(iter(self.queue.values()))
            target = self._pick(request, room)
            if target is None:
                break  # FCFS: nobody may overtake the head of the queue
            blocks, seqs = room[target]
            room[target] = (blocks - reservation_blocks(request, self.engines[target].status), seqs - 1)
            batches.setdefault(target, []).append(self.queue.pop(request.request_id))
        decisions = []
        for replica, requests in batches.items():
            view = self.engines[replica]
            view.sent_sequence += 1
            view.unacked[view.sent_sequence] = (now, requests)
            decisions.append((replica, view.sent_sequence, requests))
        return decisions

    def unacknowledged(self, now: float, older_than_s: float) -> list[tuple[str, int, list[TokenizedRequest]]]:
        """Admits no status has acknowledged for `older_than_s` (lost on the way, with NATS away, or
        the acknowledgement was): to send again, now, as they were (the engine drops a repeat)."""
        again = []
        for replica, view in self.engines.items():
            for sequence, (sent_at, requests) in sorted(view.unacked.items()):
                if now - sent_at >= older_than_s:
                    view.unacked[sequence] = (now, requests)
                    again.append((replica, sequence, requests))
        return again

    def _pick(self, request: TokenizedRequest, room: dict[str, tuple[int, int]]) -> str | None:
        """The engine with the most free blocks that can take the request's reservation."""
        best, best_blocks = None, -1
        for name, (blocks, seqs) in room.items():
            need = reservation_blocks(request, self.engines[name].status)
            if seqs > 0 and blocks >= need and blocks > best_blocks:
                best, best_blocks = name, blocks
        return best

    def unservable(self, request: TokenizedRequest) -> str | None:
        """Why no known engine could ever take this request, or None."""
        ready = [v.status for v in self.engines.values() if v.status.ready]
        if not ready:
            return None
        if all(len(request.prompt_token_ids) >= s.max_model_len for s in ready):
            return (f"prompt has {len(request.prompt_token_ids)} tokens; the model's context is "
                    f"{max(s.max_model_len for s in ready)}, leaving no room to generate")
        if all(reservation_blocks(request, s) > s.num_blocks for s in ready):
            return "the request needs more KV slots (prompt + max_tokens) than any engine's cache holds"
        return None
