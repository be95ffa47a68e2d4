"""Issue #19: the chaos matrix. On the shared `orca serve` stack, under steady NATS and HTTP load,
one process of each kind is SIGKILLed (engine master, worker, tokenizer, admission, jobs, gateway
replica, Serve proxy) or SIGSTOPped (engine master, tokenizer: hung, not dead), one row at a time.
Every row: sent = completed + errored + hung + lost, with lost = 0 and hung = 0; errored = 0 except
for the HTTP responses a dying gateway replica (or Serve proxy, which holds the connections unless
Serve runs with direct ingress) was writing; every completed request carries the
in-process engine's greedy tokens (text, over HTTP); /health is 503 within 5 s when what serves is
gone and 200 again once it is back (unless it was back, heartbeating, before its last heartbeat
expired: then nothing could tell the gateway it had gone); a request sent after the fault is served within 30 s, over
NATS and over HTTP.
The table is printed by the last test (`-s`) and kept in benchmarks/RELIABILITY.md."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import subjects
from tests.reliability import chaos
from tests.reliability.helpers import (connect, greedy_outputs, job_results, publish_job, results_stored, run,
                                       wait_engines_idle)

pytestmark = pytest.mark.slow

WARMUP_S = 2.0
"""Load before the fault: streams in flight and requests queued in admission (six clients for four
sequences: from the first second on)."""
ROW_LIMIT_S = 45.0
UNHEALTHY_WITHIN_S = 5.0
SERVED_WITHIN_S = 30.0
JOBS = 3
ROWS = [
    # kind, how, /health must go 503 (True), must stay 200 (False), either (None)
    ("engine master", "kill", True),
    ("engine master", "stop", True),
    ("worker", "kill", None),
    ("tokenizer", "kill", True),
    ("tokenizer", "stop", True),
    ("admission", "kill", None),
    ("jobs", "kill", False),
    ("gateway replica", "kill", True),
    ("Serve proxy", "kill", None),  # holds the HTTP connections in proxy mode, none under direct ingress
]
HTTP_FRONT = ("gateway replica", "Serve proxy")
"""Kinds that hold clients' HTTP connections: the responses they were writing are cut (the client
sees the error), nothing else may fail."""
TABLE: dict[str, dict] = {}


@pytest.fixture(scope="module")
def expected(demo_model) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Per prompt, the in-process engine's greedy tokens (NATS) and the text of the first
    HTTP_MAX_TOKENS of them (HTTP)."""
    from engine.tokenizer import load_tokenizer

    bodies = [{"id": p, "prompt": p, "max_tokens": chaos.NATS_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
              for p in chaos.PROMPTS]
    tokens = greedy_outputs(demo_model, bodies)
    tokenizer = load_tokenizer(demo_model)
    return tokens, {p: tokenizer.decode(t[:chaos.HTTP_MAX_TOKENS]) for p, t in tokens.items()}


@pytest.mark.parametrize(("kind", "how", "goes_unhealthy"), ROWS, ids=[f"{how}-{kind}" for kind, how, _ in ROWS])
def test_chaos_row(stack, expected, demo_model, kind, how, goes_unhealthy):
    label = f"{how}-{kind.replace(' ', '-')}"
    out = run(one_row(stack, expected, demo_model, kind, how, label), 300)
    TABLE[label] = out
    ledger, figures = out["ledger"], out["figures"]
    print(label, {k: v for k, v in out.items() if k != "ledger"}, vars(ledger) | {"completions": len(ledger.completions)})
    assert ledger.sent == ledger.completed + ledger.errored + ledger.hung + ledger.lost
    assert ledger.lost == 0 and ledger.hung == 0, ledger.problems
    if kind in HTTP_FRONT:
        assert ledger.errored == ledger.http_errored, ledger.problems  # its open HTTP responses, nothing else
    else:
        assert ledger.errored == 0, ledger.problems
    assert out["served_after_s"] is not None and out["served_after_s"] <= SERVED_WITHIN_S, out
    assert out["http_served_after_s"] is not None and out["http_served_after_s"] <= SERVED_WITHIN_S, out
    if goes_unhealthy and figures["unhealthy_s"] is None and out["tokenizer_gap_s"] is not None:
        # a tokenizer back before its last heartbeat expired: nothing told the gateway it was gone
        assert out["tokenizer_gap_s"] < chaos.STATUS_EXPIRY_S + chaos.HEALTH_POLL_SLACK_S, out
    elif goes_unhealthy:
        assert figures["unhealthy_s"] is not None and figures["unhealthy_s"] <= UNHEALTHY_WITHIN_S, figures
        assert figures["healthy_again_s"] is not None, figures
    elif goes_unhealthy is False:
        assert figures["unhealthy_s"] is None, f"/health said 503 while everything served: {figures}"
    if how == "stop":
        assert out["still_stopped"] is False, f"the hung {kind} was never killed"
    if kind == "jobs":
        assert out["jobs"]["ok"], out["jobs"]


async def one_row(stack, expected, demo_model, kind: str, how: str, label: str) -> dict:
    await chaos.wait_healthy(stack.http_url, 120)
    tokens, texts = expected
    load = chaos.Load(stack.nats_url, stack.http_url, tokens, texts, label)
    beats = chaos.TokenizerBeats()  # heard through the warm-up, so the last beat before the fault is known
    await beats.start(stack.nats_url)
    await load.start()
    await asyncio.sleep(WARMUP_S)
    jobs = await start_jobs(stack, label) if kind == "jobs" else None
    pid = chaos.strike(stack.serve.process.pid, kind, how)
    fault_at = time.monotonic()
    figures: dict[str, float | None] = {}
    done = asyncio.Event()
    health = asyncio.create_task(chaos.watch_health(stack.http_url, fault_at, done, figures))
    while time.monotonic() - fault_at < ROW_LIMIT_S:
        told = figures.get("unhealthy_s") is None or figures.get("healthy_again_s") is not None
        served = all(load.ledger.served_after(fault_at, how) is not None for how in ("nats", "http"))
        if served and told and time.monotonic() - fault_at > 6:
            break
        await asyncio.sleep(0.25)
    await load.stop()
    done.set()
    await health
    await beats.stop()
    still_stopped = _stopped(pid) if how == "stop" else None
    if how == "stop":
        chaos.release(pid)
    out = {"ledger": load.ledger, "figures": figures, "served_after_s": load.ledger.served_after(fault_at),
           "http_served_after_s": load.ledger.served_after(fault_at, "http"), "still_stopped": still_stopped,
           "tokenizer_gap_s": beats.gap_at(fault_at) if kind == "tokenizer" else None}
    if jobs is not None:
        out["jobs"] = await finish_jobs(stack, jobs, demo_model)
        out["jobs"]["done_s"] = round(time.monotonic() - fault_at, 1)
    return out


async def start_jobs(stack, label: str) -> dict:
    """Jobs long enough to be in flight when the jobs service dies (JetStream redelivers them)."""
    nc = await connect(stack.nats_url)
    js = nc.jetstream()
    bodies = [{"id": f"{label}-job-{i}", "prompt": f"y = {i}", "max_tokens": 400, "temperature": 0,
               "ignore_eos": True} for i in range(JOBS)]
    before = await results_stored(js)
    for body in bodies:
        await publish_job(js, body, 30)
    deadline = time.monotonic() + 10
    while (await js.consumer_info(subjects.JOBS_STREAM, subjects.JOBS_CONSUMER)).num_ack_pending < JOBS:
        assert time.monotonic() < deadline, "the jobs service did not take the jobs"
        await asyncio.sleep(0.05)
    return {"nc": nc, "js": js, "bodies": bodies, "before": before}


async def finish_jobs(stack, jobs: dict, demo_model: str) -> dict:
    """Every job, taken by the jobs service before it died, has exactly one stored result with the
    greedy tokens (JetStream hands a dead consumer's jobs out again after the ack wait, conftest.JOBS_ACK_WAIT_S)."""
    expected = await asyncio.to_thread(greedy_outputs, demo_model, jobs["bodies"])
    stored = await job_results(jobs["js"], [b["id"] for b in jobs["bodies"]], 90)
    count = await results_stored(jobs["js"]) - jobs["before"]
    await jobs["nc"].close()
    whole = [b["id"] for b in jobs["bodies"] if stored.get(b["id"], {}).get("token_ids") == expected[b["id"]]]
    return {"stored": count, "whole": len(whole), "ok": count == JOBS and len(whole) == JOBS}


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_after_the_matrix_no_kv_leaked_and_the_table(stack):
    idle_s = wait_engines_idle(stack.nats_url, 90)
    print(f"\nengines idle (no KV in use) {idle_s:.1f} s after the last row")
    print("| fault | sent | completed | errored | hung | lost | refused, resent | /health 503 after | 200 again after "
          "| new request served after (HTTP) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, out in TABLE.items():
        ledger, figures = out["ledger"], out["figures"]
        print(f"| {label} | {ledger.sent} | {ledger.completed} | {ledger.errored} | {ledger.hung} | {ledger.lost} "
              f"| {ledger.refusals}, {ledger.resends} | {_s(figures.get('unhealthy_s'))} "
              f"| {_s(figures.get('healthy_again_s'))} | {_s(out['served_after_s'])} ({_s(out['http_served_after_s'])}) |")
    assert TABLE, "no row ran"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"
