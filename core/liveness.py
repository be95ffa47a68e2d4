"""Who is alive, judged from heartbeats: each service instance publishes its status on a fixed
period, and one whose last status is older than the expiry is gone, whether it died or hangs.

Pure: the caller passes the clock. Admission (which engines to route to) and tokenizers (which
engines still hold their requests) keep one `Heartbeats` each over the same engine statuses, so
they reach the same verdict within a heartbeat of each other.

A name (an engine replica) has one incarnation at a time: a status from a new incarnation means
the old one is gone at once, with everything it held, without waiting for the expiry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STALLED_OBSERVER_S = 1.0
"""If the observer itself did not look for this long (its own event loop was blocked), the statuses
that arrived meanwhile may still wait in its buffer: it judges nobody until it has read them."""


@dataclass
class Heartbeats:
    expiry_s: float
    last: dict[str, tuple[str, float]] = field(default_factory=dict)
    """name -> (incarnation, when its latest status came)."""
    _looked_at: float | None = None

    def beat(self, name: str, incarnation: str, now: float) -> str | None:
        """Record a status; returns the incarnation it replaces (gone with what it held), if any."""
        previous = self.last.get(name)
        self.last[name] = (incarnation, now)
        if previous is not None and previous[0] != incarnation:
            return previous[0]
        return None

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Forget and return (name, incarnation) of those silent for longer than the expiry."""
        stalled = self._looked_at is not None and now - self._looked_at > STALLED_OBSERVER_S
        self._looked_at = now
        if stalled:
            return []
        gone = [(name, inc) for name, (inc, at) in self.last.items() if now - at > self.expiry_s]
        for name, _ in gone:
            del self.last[name]
        return gone

    def restart_clocks(self, now: float) -> None:
        """The observer could not hear anyone for a while (its own connection was down): everyone known
        gets a full expiry from now to be heard again."""
        self.last = {name: (incarnation, now) for name, (incarnation, _) in self.last.items()}
        self._looked_at = now

    def alive(self, name: str, incarnation: str) -> bool:
        entry = self.last.get(name)
        return entry is not None and entry[0] == incarnation

    def forget(self, name: str) -> None:
        self.last.pop(name, None)
