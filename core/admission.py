"""The admission scheduler's core: one global FCFS queue, engines' reported room, decisions.

Pure: status messages in, `(engine, requests)` decisions out. It keeps no KV ledger of its
own: an engine's room is what that engine last reported, and after an Admit the engine is
not offered more until a status echoes that Admit (so a report is never counted twice).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.messages import EngineStatus, TokenizedRequest


class QueueFull(Exception):
    pass


@dataclass
class EngineView:
    status: EngineStatus
    sent_sequence: int = 0

    @property
    def acknowledged(self) -> bool:
        return self.status.last_admit_sequence >= self.sent_sequence


def reservation_blocks(request: TokenizedRequest, status: EngineStatus) -> int:
    slots = min(len(request.prompt_token_ids) + request.params.max_tokens, status.max_model_len)
    return -(-slots // status.block_size)


class AdmissionQueue:
    def __init__(self, max_queue_len: int) -> None:
        self.max_queue_len = max_queue_len
        self.queue: OrderedDict[str, TokenizedRequest] = OrderedDict()
        self.engines: dict[str, EngineView] = {}

    def submit(self, request: TokenizedRequest) -> None:
        if request.request_id in self.queue:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        if len(self.queue) >= self.max_queue_len:
            raise QueueFull(f"the admission queue is full ({self.max_queue_len} requests); retry later")
        self.queue[request.request_id] = request
        if request.priority != 0 and any(r.priority > request.priority for r in self.queue.values()):
            # keep the queue ordered by (priority, arrival); the sort is stable, so FCFS within a priority
            ordered = sorted(self.queue.values(), key=lambda r: r.priority)
            self.queue = OrderedDict((r.request_id, r) for r in ordered)

    def remove(self, request_id: str) -> TokenizedRequest | None:
        return self.queue.pop(request_id, None)

    def on_status(self, status: EngineStatus) -> None:
        view = self.engines.get(status.replica)
        if view is None or view.status.incarnation != status.incarnation:
            self.engines[status.replica] = EngineView(status, status.last_admit_sequence)
        else:
            view.status = status

    def forget_engine(self, replica: str) -> None:
        self.engines.pop(replica, None)

    def decide(self) -> list[tuple[str, int, list[TokenizedRequest]]]:
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
            decisions.append((replica, view.sent_sequence, requests))
        return decisions

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
