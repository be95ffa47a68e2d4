"""An in-memory NATS connection for the tests of a service's logic: what a service calls on its
nats.py client, with every publish recorded. A test subclasses `publish` to answer what it needs."""

from __future__ import annotations


class RecordingNats:
    """Records every publish as (subject, payload) and every subscribed subject; subscribing delivers
    nothing and flushing does nothing."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.subscribed: list[str] = []
        self.is_closed = False
        self.is_connected = True

    def new_inbox(self) -> str:
        return "_INBOX.fake"

    async def subscribe(self, subject: str, queue: str = "", cb=None) -> None:
        self.subscribed.append(subject)

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        self.published.append((subject, payload))

    async def flush(self, timeout: float = 0) -> None:
        return None

    def on(self, subject: str) -> list[bytes]:
        """The payloads published to `subject`, in order."""
        return [data for s, data in self.published if s == subject]
