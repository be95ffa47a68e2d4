"""The chaos matrix's machinery: steady load over NATS and HTTP on the shared stack, one fault (a
SIGKILL or a SIGSTOP of one process of a kind), a ledger of every request, and the times the
system took to tell the truth (/health) and to serve a new request.

Ledger terms (benchmarks/RELIABILITY.md): every request *sent* ends *completed* (whole, and with
the in-process engine's greedy tokens), *errored* (a final error event, or an HTTP error after the
request was accepted), *hung* (no final event within REQUEST_TIMEOUT_S) or *lost* (anything else:
a stream cut short, wrong tokens, a client that died). A request the gateway refused at the door
(503 with Retry-After, or no connection) is retried by its client, as a client should; refusals
are counted apart.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

import httpx

from shared import subjects
from shared.codec import Codec
from shared.messages import STATUS_EXPIRY_S, TokenizerStatus
from tests.reliability.helpers import connect, resumable_stream, tokens_of
from tests.services.stack import descendants

REQUEST_TIMEOUT_S = 60.0
NATS_CLIENTS, HTTP_CLIENTS = 4, 2
NATS_MAX_TOKENS, HTTP_MAX_TOKENS = 48, 40
PROMPTS = ["def main():", "import os", "x = 1", "class A:"]
PATTERNS = {
    "engine master": "ray::EngineMasterActor", "worker": "ray::Worker", "tokenizer": "-m services.tokenizer",
    "admission": "-m services.admission", "jobs": "-m services.jobs",
    "gateway replica": "ray::ServeReplica:orca-gateway", "Serve proxy": "ray::ProxyActor",
}


def bodies() -> list[dict]:
    """The distinct requests the load sends (with ids and stream flags added per send)."""
    nats = [{"prompt": p, "max_tokens": NATS_MAX_TOKENS, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    http = [{"prompt": p, "max_tokens": HTTP_MAX_TOKENS, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    return nats + http


@dataclass
class Ledger:
    """Every request a load sent, by how it ended (the terms above)."""

    sent: int = 0
    completed: int = 0
    errored: int = 0
    hung: int = 0
    lost: int = 0
    refusals: int = 0
    resends: int = 0
    http_errored: int = 0
    completions: list[tuple[float, float, str]] = field(default_factory=list)
    """(sent at, done at, "nats" or "http") of each completed request, on the clock its faults are timed by."""
    problems: list[str] = field(default_factory=list)

    def served_after(self, fault_at: float, transport: str | None = None) -> float | None:
        """From the fault to the first completion of a request sent after it (over `transport`)."""
        done = [end for start, end, how in self.completions if start >= fault_at and transport in (None, how)]
        return min(done) - fault_at if done else None

    def note(self, kind: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {what}")


class Load:
    """NATS_CLIENTS + HTTP_CLIENTS clients, each sending one request after another until stopped."""

    def __init__(self, nats_url: str, http_url: str, expected: dict[str, list[int]], texts: dict[str, str],
                 label: str) -> None:
        self.nats_url, self.http_url = nats_url, http_url
        self.expected, self.texts, self.label = expected, texts, label
        self.ledger = Ledger()
        self.stopping = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.nc = await connect(self.nats_url)
        self.http = httpx.AsyncClient(base_url=self.http_url, timeout=REQUEST_TIMEOUT_S)
        self._tasks = [asyncio.create_task(self._nats_client(i)) for i in range(NATS_CLIENTS)]
        self._tasks += [asyncio.create_task(self._http_client(i)) for i in range(HTTP_CLIENTS)]

    async def stop(self) -> None:
        """Stop sending; every request in flight ends (or counts as hung) within REQUEST_TIMEOUT_S."""
        self.stopping = True
        await asyncio.gather(*self._tasks)
        await self.http.aclose()
        await self.nc.close()

    async def _nats_client(self, n: int) -> None:
        i = 0
        while not self.stopping:
            i += 1
            prompt = PROMPTS[(n + i) % len(PROMPTS)]
            body = {"id": f"{self.label}-n{n}-{i}", "prompt": prompt, "max_tokens": NATS_MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            sent_at, stats = time.monotonic(), {}
            self.ledger.sent += 1
            try:
                events = await resumable_stream(self.nc, body, REQUEST_TIMEOUT_S, stats)
            except TimeoutError:
                self.ledger.note("hung", body["id"])
                continue
            except Exception as exc:  # noqa: BLE001 - a client that failed: the request is unaccounted for
                self.ledger.note("lost", f"{body['id']}: {exc!r}")
                continue
            self.ledger.resends += stats.get("resends", 0)
            self._judge(body["id"], events, self.expected[prompt], sent_at)

    def _judge(self, request_id: str, events: list[dict], expected: list[int], sent_at: float) -> None:
        final = events[-1]
        if sum(e["finish_reason"] is not None for e in events) != 1:
            self.ledger.note("lost", f"{request_id}: {sum(e['finish_reason'] is not None for e in events)} ends")
        elif final["finish_reason"] == "error":
            self.ledger.note("errored", f"{request_id}: {final.get('error')}")
        elif final["finish_reason"] == "length" and tokens_of(events) == expected:
            self.ledger.completed += 1
            self.ledger.completions.append((sent_at, time.monotonic(), "nats"))
        else:
            self.ledger.note("lost", f"{request_id}: {final['finish_reason']} with {len(tokens_of(events))} tokens, "
                                     f"{'equal' if tokens_of(events) == expected[:len(tokens_of(events))] else 'wrong'}")

    async def _http_client(self, n: int) -> None:
        i = 0
        while not self.stopping:
            i += 1
            prompt = PROMPTS[(n + i) % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": HTTP_MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            sent_at = time.monotonic()
            self.ledger.sent += 1
            try:
                outcome = await asyncio.wait_for(self._http_request(body), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.ledger.note("hung", f"http {self.label}-h{n}-{i}")
                continue
            if outcome == "ok-text" + self.texts[prompt]:
                self.ledger.completed += 1
                self.ledger.completions.append((sent_at, time.monotonic(), "http"))
            elif outcome.startswith("error"):
                self.ledger.http_errored += 1
                self.ledger.note("errored", f"http {self.label}-h{n}-{i}: {outcome[:200]}")
            else:
                self.ledger.note("lost", f"http {self.label}-h{n}-{i}: {outcome[:200]}")

    async def _http_request(self, body: dict) -> str:
        """'ok-text<the text>', 'error: why', or what went wrong; refusals are retried."""
        while True:
            try:
                async with self.http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code in (503, 429):
                        self.ledger.refusals += 1
                        await asyncio.sleep(float(response.headers.get("retry-after", "1")) / 5)
                        continue
                    if response.status_code != 200:
                        return f"error: HTTP {response.status_code} {(await response.aread())[:200]!r}"
                    return await _sse_text(response)
            except (httpx.ConnectError, httpx.ConnectTimeout):  # the gateway is away: not accepted yet
                self.ledger.refusals += 1
                await asyncio.sleep(0.5)
            except httpx.HTTPError as exc:  # accepted, then cut: the client knows it failed
                return f"error: {exc!r}"


async def _sse_text(response: httpx.Response) -> str:
    text, finish = "", None
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            return f"error: {chunk['error']}"
        text += chunk["choices"][0]["text"]
        finish = chunk["choices"][0]["finish_reason"] or finish
    return f"ok-text{text}" if finish == "length" else f"cut: finish {finish}, {len(text)} chars"


# ---- faults ------------------------------------------------------------------------------------------

def processes_of(root: int, kind: str) -> list[int]:
    return [pid for pid, cmd in descendants(root) if PATTERNS[kind] in cmd]


def strike(root: int, kind: str, how: str) -> int:
    """SIGKILL ("kill") or SIGSTOP ("stop") the one process of `kind`; returns its pid."""
    pids = processes_of(root, kind)
    assert len(pids) == 1, f"expected one {kind} process, found {pids}"
    os.kill(pids[0], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    return pids[0]


def release(pid: int) -> None:
    """After a SIGSTOP row: if nobody killed the stopped process (a failure the row reports), kill it
    now so the next rows run on a working stack."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def watch_health(http_url: str, fault_at: float, until: asyncio.Event, figures: dict) -> None:
    """After the fault, into `figures`: seconds to the first /health that is not 200 (503, or no
    answer: the gateway is away), and to the first 200 after that."""
    figures.update(unhealthy_s=None, healthy_again_s=None)
    async with httpx.AsyncClient(base_url=http_url, timeout=2) as client:
        while not until.is_set():
            try:
                ok = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            now = time.monotonic() - fault_at
            if not ok and figures["unhealthy_s"] is None:
                figures["unhealthy_s"] = now
            if ok and figures["unhealthy_s"] is not None and figures["healthy_again_s"] is None:
                figures["healthy_again_s"] = now
            await asyncio.sleep(0.1)


HEALTH_POLL_SLACK_S = 0.25
"""A 503 shorter than this can fall between two of watch_health's polls (0.1 s apart, plus the answer)."""


class TokenizerBeats:
    """Every tokenizer heartbeat, by instance: when each instance was first and last heard."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._codec = Codec(TokenizerStatus)
        self._nc = None

    async def start(self, nats_url: str) -> None:
        self._nc = await connect(nats_url)
        await self._nc.subscribe(subjects.TOKENIZER_STATUS, cb=self._on_status)

    async def stop(self) -> None:
        await self._nc.close()

    async def _on_status(self, msg) -> None:
        instance, now = self._codec.decode(msg.data).instance, time.monotonic()
        self.first.setdefault(instance, now)
        self.last[instance] = now

    def gap_at(self, fault_at: float) -> float | None:
        """Seconds between the last heartbeat of the tokenizers heard before the fault and the first
        of one heard only after it (None: no new tokenizer was heard)."""
        before = [at for instance, at in self.last.items() if self.first[instance] < fault_at]
        after = [at for at in self.first.values() if at >= fault_at]
        if not before or not after:
            return None
        return min(after) - min(max(before), fault_at)

    def replaced_unseen(self, fault_at: float) -> bool:
        """A new tokenizer heartbeat came before the gateway could stop believing the old one's: then
        /health rightly never says 503 (the outage was shorter than the heartbeat expiry)."""
        gap = self.gap_at(fault_at)
        return gap is not None and gap < STATUS_EXPIRY_S + HEALTH_POLL_SLACK_S


async def wait_healthy(http_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=http_url, timeout=2) as client:
        while True:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the stack is not healthy after {timeout_s} s")
            await asyncio.sleep(0.2)
