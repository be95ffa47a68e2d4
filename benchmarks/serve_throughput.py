"""Throughput through `orca serve` over NATS vs the in-process engine, same workload, one run.

Also prints the per-iteration control overhead the engine master measures: iteration wall time
(schedule, step message, worker, result message, update, publish) minus the worker's time in
the model runner.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        python benchmarks/serve_throughput.py --model .cache/demo-llama --num-requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nats  # noqa: E402

from benchmarks.common import engine_parser, make_engine, write_summary  # noqa: E402
from benchmarks.engine_throughput import run_engine, warm_up  # noqa: E402
from benchmarks.workload import orca_paper_workload  # noqa: E402
from services.cli import engine_config_from_args  # noqa: E402
from shared import flags, subjects  # noqa: E402
from shared.codec import Codec  # noqa: E402
from shared.messages import EngineStatus  # noqa: E402


def engine_argv(args: argparse.Namespace) -> list[str]:
    """This run's engine flags as `orca serve` takes them, so it serves the engine measured in process."""
    return flags.engine_argv(engine_config_from_args(args))


def start_serve(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "services.cli", "serve", *engine_argv(args), "--port", str(args.port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 300
    while not any("orca-serve is up" in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("orca serve did not start:\n" + "".join(lines[-40:]))
        time.sleep(0.2)
    url = re.search(r"nats://[\d.]+:\d+", next(line for line in lines if "orca-serve is up" in line)).group(0)
    return proc, url


async def latest_status(nc) -> EngineStatus:
    codec, got = Codec(EngineStatus), asyncio.get_running_loop().create_future()

    async def on_status(msg) -> None:
        if not got.done():
            got.set_result(codec.decode(msg.data))
    subs = [await nc.subscribe(subject, cb=on_status) for subject in (subjects.ENGINE_STATUS, subjects.ENGINE_PROGRESS)]
    status = await asyncio.wait_for(got, 10)
    for sub in subs:
        await sub.unsubscribe()
    return status


async def run_over_nats(url: str, workload: list[dict]) -> dict:
    nc = await nats.connect(url, pending_size=256 * 1024 * 1024)
    finished = asyncio.Event()
    generated = done = 0

    async def on_event(msg) -> None:
        nonlocal generated, done
        event = json.loads(msg.data)
        generated += len(event["token_ids"])
        if event["finish_reason"] is not None:
            done += 1
            if done % 32 == 0:
                print(f"  [nats] {done}/{len(workload)} requests", file=sys.stderr)
            if done == len(workload):
                finished.set()
    inbox = nc.new_inbox()
    await nc.subscribe(inbox + ".*", cb=on_event)
    warm = {"id": "warmup", "prompt_token_ids": list(range(10, 74)), "max_tokens": 4, "temperature": 0}
    await nc.request(subjects.GENERATE, json.dumps(warm).encode(), timeout=60)
    await asyncio.sleep(1.0)
    before = await latest_status(nc)
    start = time.perf_counter()
    for request in workload:
        await nc.publish(subjects.GENERATE, json.dumps(request).encode(), reply=f"{inbox}.{request['id']}")
    await asyncio.wait_for(finished.wait(), 3600)
    seconds = time.perf_counter() - start
    await asyncio.sleep(0.5)
    after = await latest_status(nc)
    await nc.close()
    steps = after.steps - before.steps
    overhead = (after.step_seconds - before.step_seconds) - (after.execute_seconds - before.execute_seconds)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "iterations": steps, "control_overhead_ms_per_iteration": 1000 * overhead / max(steps, 1),
            "runner_share_of_iteration": (after.execute_seconds - before.execute_seconds)
            / max(after.step_seconds - before.step_seconds, 1e-9)}


def main() -> None:
    parser = engine_parser(__doc__, num_requests=128, kv_cache_tokens=131072)  # `orca serve` gets the same flags
    parser.add_argument("--out")
    parser.add_argument("--port", type=int, default=0, help="the HTTP port of the orca serve it starts (0: any free)")
    args = parser.parse_args()
    workload = orca_paper_workload(args.num_requests, args.seed)

    engine = make_engine(args)
    warm_up(engine)
    local = run_engine(engine, workload, "in-process")
    del engine
    proc, url = start_serve(args)
    try:
        served = asyncio.run(run_over_nats(url, workload))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    summary = {
        "workload": f"{args.num_requests} requests, input U[32,512], output U[1,128], EOS ignored, all at once",
        "in_process_tokens_per_s": round(local["tokens_per_s"], 1),
        "serve_over_nats_tokens_per_s": round(served["tokens_per_s"], 1),
        "serve_over_in_process": round(served["tokens_per_s"] / local["tokens_per_s"], 3),
        "control_overhead_ms_per_iteration": round(served["control_overhead_ms_per_iteration"], 2),
        "runner_share_of_iteration": round(served["runner_share_of_iteration"], 3),
        "iterations": served["iterations"],
        "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", ""),
    }
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
