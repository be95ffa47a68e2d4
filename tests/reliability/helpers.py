"""What the reliability tests share: a nats-server the test can kill and restart (same port, same
JetStream store), its monitoring endpoint, NATS streams that never wait forever, and /proc readings
(processes, memory, file descriptors) of an `orca serve` session."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats

from services.nats_server import MAX_PAYLOAD, free_port, nats_server_binary, terminate
from shared import subjects
from shared.client import generate
from tests.services.stack import descendants, engine_statuses, worker_pids


class Broker:
    """nats-server with JetStream on file storage and HTTP monitoring, both on loopback. `restart`
    kills it (SIGKILL: a crash, not a shutdown) and starts it again on the same port and store."""

    def __init__(self, store_dir: Path) -> None:
        self.port, self.monitor_port = free_port(), free_port()
        self.store_dir = store_dir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Broker:
        config = self.store_dir / "nats.conf"
        config.write_text(f'listen: "127.0.0.1:{self.port}"\nhttp: "127.0.0.1:{self.monitor_port}"\n'
                          f'max_payload: {MAX_PAYLOAD}\njetstream {{ store_dir: "{self.store_dir / "js"}" }}\n')
        self.process = subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.monitor("healthz?js-enabled-only=true"), timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not come up on port {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self, down_s: float) -> None:
        self.kill()
        time.sleep(down_s)
        self.start()

    def monitor(self, path: str) -> str:
        return f"http://127.0.0.1:{self.monitor_port}/{path}"

    def subscriptions(self) -> int:
        return httpx.get(self.monitor("subsz"), timeout=5).json()["num_subscriptions"]

    def connections(self) -> int:
        return httpx.get(self.monitor("connz"), timeout=5).json()["num_connections"]

    def subscribed(self) -> list[str]:
        """Each connection's subscriptions as 'client name: subject', sorted (to tell which one leaked)."""
        body = httpx.get(self.monitor("connz?subs=1&limit=4096"), timeout=5).json()
        return sorted(f"{c.get('name', '')}: {subject}" for c in body.get("connections") or []
                      for subject in c.get("subscriptions_list") or [])

    def stop(self) -> None:
        terminate(self.process)


async def connect(url: str) -> nats.NATS:
    """A producer's connection: reconnects quickly and forever, as the services' own do."""
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5)


async def stream(nc, body: dict, timeout_s: float, stats: dict | None = None, on_event=None) -> list[dict]:
    """One generate request's events up to the final one, as a client following the README's rule
    (`shared.client.generate`: events in `seq` order, a replay after a gap, a silence or a reconnect,
    a resend when no tokenizer holds the request, a 503 retried); TimeoutError if the final event does
    not come within `timeout_s` (a lost request: the tests count it, they never wait forever). `stats`
    counts "replays", "resends" and "retries"."""
    return await generate(nc, body, timeout_s=timeout_s, stats=stats, on_event=on_event)


resumable_stream = stream


def tokens_of(events: list[dict]) -> list[int]:
    return [t for e in events for t in e["token_ids"]]


# ---- processes of a session -------------------------------------------------------------------

def start_time(pid: int) -> int | None:
    """The process' start time in clock ticks (with the pid, a process' identity), or None if it
    is gone or a zombie (exited, only not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


@dataclass
class Session:
    """Every process an `orca serve` started (its whole tree, Ray's included)."""

    root: int
    processes: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (start time, command line)

    def snapshot(self) -> Session:
        for pid, cmdline in [(self.root, "orca serve"), *descendants(self.root)]:
            started = start_time(pid)
            if started is not None:
                self.processes[pid] = (started, cmdline)
        return self

    def survivors(self) -> list[str]:
        return [cmd for pid, (started, cmd) in self.processes.items() if start_time(pid) == started]

    def rss_kib(self) -> int:
        return sum(_status_kib(pid, "VmRSS") for pid in self._alive())

    def open_fds(self) -> int:
        return sum(_count(f"/proc/{pid}/fd") for pid in self._alive())

    def _alive(self) -> list[int]:
        return [pid for pid, _ in [(self.root, ""), *descendants(self.root)] if start_time(pid) is not None]


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def run(coro, timeout_s: float):
    """asyncio.run with a bound: a test never hangs."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def greedy_outputs(model: str, bodies: list[dict]) -> dict[str, list[int]]:
    """Each request's token ids from the in-process engine (no NATS, no Ray): what a stream that
    was neither cut nor disturbed must carry."""
    import io

    from engine.batch_job import run_batch
    from engine.llm_engine import LLMEngine
    from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model), scheduler=SchedulerConfig(max_num_seqs=4),
                                    cache=CacheConfig(kv_cache_tokens=8192)))
    out = io.StringIO()
    run_batch(engine, [json.dumps(b) for b in bodies], out, progress=False)
    return {r["id"]: r["token_ids"] for r in map(json.loads, out.getvalue().splitlines())}


def long_requests(prefix: str, n: int, max_tokens: int) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "prompt": f"x = {i}", "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True} for i in range(n)]


@asynccontextmanager
async def streaming(nats_url: str, http_url: str, bodies: list[dict],
                    timeout_s: float) -> AsyncIterator[tuple[httpx.AsyncClient, list[asyncio.Task]]]:
    """A gateway that answered /health with 200, and `bodies` streaming over NATS with tokens
    already flowing (each task: one request's events): the moment a fault test strikes."""
    nc = await connect(nats_url)
    async with httpx.AsyncClient(base_url=http_url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 200
        tasks = [asyncio.create_task(stream(nc, b, timeout_s=timeout_s)) for b in bodies]
        await asyncio.sleep(0.5)  # tokens are flowing
        yield client, tasks
    await nc.close()


async def timed_completion(client: httpx.AsyncClient, prompt: str) -> tuple[httpx.Response, float]:
    """A 4-token completion over HTTP: the response, and the seconds the gateway took to give it."""
    asked = time.monotonic()
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    return response, time.monotonic() - asked


def assert_worker_replaced(stack, old_pid: int) -> None:
    """Ray restarted the session's one worker (a new process), and every engine is ready with no KV in use."""
    assert old_pid not in worker_pids(stack.serve) and len(worker_pids(stack.serve)) == 1, "restarted by Ray"
    statuses = run(engine_statuses(stack.nats_url), 30)
    assert statuses and all(s.ready and s.kv_used_blocks == 0 for s in statuses.values())


async def wait_for_health(client: httpx.AsyncClient, code: int, timeout_s: float) -> float:
    """Seconds until GET /health answers `code`; AssertionError after `timeout_s`."""
    start = time.monotonic()
    while (await client.get("/health")).status_code != code:
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"/health did not answer {code} within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


# ---- durable jobs ------------------------------------------------------------------------------

async def publish_job(js, body: dict, timeout_s: float) -> None:
    """Publish until JetStream acknowledges it (the broker may be away); the Nats-Msg-Id header
    makes a retried publish count once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await js.publish(subjects.JOBS_SUBMIT, json.dumps(body).encode(), headers={"Nats-Msg-Id": body["id"]},
                             timeout=2)
            return
        except Exception:  # noqa: BLE001 - timeouts, no responders, reconnecting: retry
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def job_results(js, ids: list[str], timeout_s: float) -> dict[str, dict]:
    results: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(ids) and time.monotonic() < deadline:
        for job_id in ids:
            if job_id not in results:
                try:
                    msg = await js.get_last_msg(subjects.JOBS_RESULTS_STREAM, subjects.jobs_result(job_id))
                    results[job_id] = json.loads(msg.data)
                except (nats.js.errors.NotFoundError, nats.errors.TimeoutError):
                    pass
        await asyncio.sleep(0.2)
    return results


async def results_stored(js) -> int:
    """Results ever stored (the results stream's last sequence): one per job, or a job ran twice."""
    try:
        return (await js.stream_info(subjects.JOBS_RESULTS_STREAM)).state.last_seq
    except nats.js.errors.NotFoundError:
        return 0


def wait_engines_idle(nats_url: str, timeout_s: float) -> float:
    """Seconds until every engine reports ready with no request and no KV block in use."""
    async def idle() -> bool:
        statuses = await engine_statuses(nats_url, seconds=1.0)
        return bool(statuses) and all(s.ready and s.kv_used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0
                                      for s in statuses.values())
    start = time.monotonic()
    while not run(idle(), 30):
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"engines not idle (KV in use) within {timeout_s} s")
    return time.monotonic() - start
