"""The cheapest NATS hop this machine allows: bare nats-py processes, no orca code, against which
`hop_latency.py`'s hops can be read.

Starts its own nats-server and an echo process, then sends small messages one at a time, twice:
back to back (the next message as soon as the echo is back), and after an idle gap (`--gap-ms`, as
a lone stream's requests are). The echo stamps each message's arrival with `time.perf_counter()`
(CLOCK_MONOTONIC, which both processes share), so a message's one-way time is measured, not halved
from its round trip. Both processes run on the cores given (`--cpus`).

    python benchmarks/nats_floor.py --cpus 0

On a VM whose idle vCPUs halt (guest halt polling off), a process woken on an idle core pays the
hypervisor's wake-up: the idle-gap rows show that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import subprocess
import sys
import time
from importlib.metadata import version

import nats

from services.nats_server import LocalNatsServer

STAMP = struct.Struct("<d")
PAYLOAD = b"x" * 200  # about an admit message's size


async def echo(url: str) -> None:
    """Replies to each message with the time it arrived."""
    nc = await nats.connect(url)

    async def on_message(msg) -> None:
        await nc.publish(msg.reply, STAMP.pack(time.perf_counter()))

    await nc.subscribe("floor.echo", cb=on_message)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(url: str, count: int, gap_s: float) -> tuple[list[float], list[float]]:
    """One-way and round-trip times in ms of `count` messages, `gap_s` apart."""
    nc = await nats.connect(url)
    for _ in range(20):
        await nc.request("floor.echo", PAYLOAD, timeout=5)
    one_way, round_trip = [], []
    for _ in range(count):
        if gap_s:
            await asyncio.sleep(gap_s)
        sent = time.perf_counter()
        reply = await nc.request("floor.echo", PAYLOAD, timeout=5)
        back = time.perf_counter()
        one_way.append((STAMP.unpack(reply.data)[0] - sent) * 1e3)
        round_trip.append((back - sent) * 1e3)
    await nc.close()
    return one_way, round_trip


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    return (f"{statistics.median(ordered):6.3f}   ({ordered[len(ordered) // 10]:.3f}-"
            f"{ordered[9 * len(ordered) // 10]:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--cpus", default="", help="cores for both processes, comma-separated (default: unbound)")
    parser.add_argument("--echo", help=argparse.SUPPRESS)  # the echo process's own entry
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.echo:
        asyncio.run(echo(args.echo))
        return
    server = LocalNatsServer().start()
    child = subprocess.Popen([sys.executable, __file__, "--echo", server.url, "--cpus", args.cpus],
                             stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("the echo process did not start")
        print(f"nats-py {version('nats-py')}, 200-byte messages, {args.count} each; "
              f"cores {args.cpus or 'unbound'}; median ms (p10-p90)")
        print(f"{'':24}{'one way':>10}{'':16}{'round trip':>12}")
        for label, gap in (("back to back", 0.0), (f"after {args.gap_ms:g} ms idle", args.gap_ms / 1e3)):
            one_way, round_trip = asyncio.run(measure(server.url, args.count, gap))
            print(f"{label:24}{summary(one_way)}   {summary(round_trip)}")
    finally:
        child.kill()
        server.stop()


if __name__ == "__main__":
    main()
