"""The load generator: sends a workload to a target at its arrival times and records what comes back.

Two drivers, one per kind of target:
- `drive_streaming` (asyncio) for targets that answer each request with a stream (NATS, HTTP):
  one task per request sleeps until the request's arrival time, takes a concurrency slot
  (`--max-concurrency`) and awaits the target's stream.
- `drive_stepped` for targets the driver steps itself, one iteration at a time: the in-process
  engine (wall clock) and the simulator (simulated clock). Between steps it adds every request
  whose arrival time has passed; a request that arrives during a step waits for the step to end,
  as it would in a server, and its latency counts from its arrival.
Both return the per-request records and the run's duration (first arrival to last completion).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loadtest.datasets import prompt_len
from loadtest.report import RequestRecord
from shared.api import GenerateRequest


class StreamingTarget(Protocol):
    async def generate(self, request: GenerateRequest, record: RequestRecord) -> None:
        """Send one request and fill `record` (chunks, finish or error) as its stream comes."""
        ...


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    """In workload order; times are absolute on the run's clock."""
    t0: float
    """When the run started (the first arrival), on that clock."""
    duration_s: float
    """First arrival to last completion."""


@dataclass(frozen=True)
class StepEvent:
    request_id: str
    num_tokens: int
    finished: bool
    error: str | None = None


class SteppedTarget(Protocol):
    def add(self, request: GenerateRequest) -> int:
        """Queue a request; return its prompt length. Raises ValueError if it cannot be served."""
        ...

    def step(self) -> list[StepEvent]:
        ...

    @property
    def has_unfinished(self) -> bool:
        ...


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, unit="req", dynamic_ncols=True, leave=False)


async def drive_streaming(target: StreamingTarget, requests: list[GenerateRequest], arrivals: list[float], *,
                          max_concurrency: int | None = None, timeout_s: float = 600.0,
                          desc: str = "", progress: bool = True) -> RunResult:
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    t0 = time.perf_counter()
    last_finish = t0

    async def one(request: GenerateRequest, arrival: float, bar) -> RequestRecord:
        nonlocal last_finish
        await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        async with slots:
            record = RequestRecord(request.id, time.perf_counter(), prompt_len(request) or 0)
            try:
                await asyncio.wait_for(target.generate(request, record), timeout_s)
            except TimeoutError:
                record.finish(time.perf_counter(), f"no final event within {timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - any transport failure is this request's failure
                record.finish(time.perf_counter(), f"{type(exc).__name__}: {exc}")
        last_finish = max(last_finish, record.finished_s or time.perf_counter())
        if bar is not None:
            bar.update(1)
        return record

    with progress_bar(len(requests), desc, progress) as bar:
        records = await asyncio.gather(*(one(r, a, bar) for r, a in zip(requests, arrivals)))
    return RunResult(list(records), t0, last_finish - t0)


def drive_stepped(target: SteppedTarget, requests: list[GenerateRequest], arrivals: list[float], *,
                  max_concurrency: int | None = None, clock: Callable[[], float] = time.perf_counter,
                  sleep_until: Callable[[float], None] | None = None, desc: str = "",
                  progress: bool = True) -> RunResult:
    """Step `target` until every request has finished; `sleep_until(t)` waits (or jumps) to clock t."""
    sleep_until = sleep_until or (lambda t: time.sleep(max(0.0, t - clock())))
    t0 = clock()
    queue = deque(zip(requests, arrivals))
    records: dict[str, RequestRecord] = {}
    in_flight, slot_freed_at, last_finish = 0, t0, t0
    with progress_bar(len(requests), desc, progress) as bar:
        while queue or target.has_unfinished:
            now = clock()
            while queue and t0 + queue[0][1] <= now and (max_concurrency is None or in_flight < max_concurrency):
                request, arrival = queue.popleft()
                start = max(t0 + arrival, slot_freed_at) if max_concurrency else t0 + arrival
                record = records[request.id] = RequestRecord(request.id, start)
                try:
                    record.prompt_len = target.add(request)
                    in_flight += 1
                except ValueError as exc:
                    record.finish(now, str(exc))
                    _tick(bar)
            if not target.has_unfinished:
                if queue:
                    sleep_until(t0 + queue[0][1])
                continue
            events = target.step()
            now = clock()
            for event in events:
                record = records[event.request_id]
                record.add_chunk(now, event.num_tokens)
                if event.finished:
                    record.finish(now, event.error)
                    in_flight -= 1
                    slot_freed_at = last_finish = now
                    _tick(bar)
    return RunResult([records[r.id] for r in requests], t0, last_finish - t0)


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)
