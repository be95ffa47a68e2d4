"""Numbered streams over core NATS, which keeps nothing for a subscriber that is away (a NATS
restart, a failover to another cluster node, a subscription not yet registered).

Every stream that must arrive whole numbers its messages 0, 1, 2, ... The producer keeps the
recent ones (`ReplayLog`); the consumer takes each message only in order (`arrival`) and, when it
sees a gap or has itself been away, asks the producer for everything from the first it lacks.
Messages sent again may also arrive twice (the original was only late): repeats are dropped.

Pure: no I/O, the clock passed in.
"""

from __future__ import annotations

import enum
from collections import deque


class Arrival(enum.Enum):
    NEXT = "next"
    """The one expected: take it."""
    REPEAT = "repeat"
    """Taken before (a replay overlapping what arrived): drop it."""
    GAP = "gap"
    """Later than the one expected, which was lost: drop it and ask for a replay from the expected one
    (the replay sends this one again too)."""


def arrival(next_seq: int, seq: int) -> Arrival:
    if seq == next_seq:
        return Arrival.NEXT
    return Arrival.REPEAT if seq < next_seq else Arrival.GAP


class ReplayLog:
    """The messages of one stream from `first_seq` on; the oldest are dropped once older than
    `window_s` (at `prune`) or beyond `max_messages` (None: no such bound)."""

    def __init__(self, first_seq: int = 0, window_s: float | None = None, max_messages: int | None = None) -> None:
        self.window_s = window_s
        self.max_messages = max_messages
        self._kept: deque[tuple[float, bytes]] = deque()
        self._first_kept = first_seq
        self.next_seq = first_seq

    def append(self, data: bytes, now: float = 0.0) -> int:
        """Keep the message numbered `next_seq` (the caller put that number in `data`); its number."""
        self._kept.append((now, data))
        self.next_seq += 1
        if self.max_messages is not None and len(self._kept) > self.max_messages:
            self._drop_oldest()
        return self.next_seq - 1

    def since(self, seq: int) -> list[bytes] | None:
        """The messages from `seq` on; None when some of them are no longer kept."""
        if seq < self._first_kept:
            return None
        start = seq - self._first_kept
        return [data for _, data in list(self._kept)[start:]]

    def prune(self, now: float) -> None:
        while self._kept and self.window_s is not None and now - self._kept[0][0] > self.window_s:
            self._drop_oldest()

    @property
    def last_at(self) -> float | None:
        return self._kept[-1][0] if self._kept else None

    def _drop_oldest(self) -> None:
        self._kept.popleft()
        self._first_kept += 1
