"""Where a single request's time to first token goes, hop by hop, on a running `orca serve`.

A NATS subscriber on every subject (`orca.v1.>` and the inboxes) timestamps each hop's first
message of a request, while the same process sends the request over HTTP (streaming
/v1/completions) or straight over NATS (`orca.v1.generate`), one at a time; the first streamed
token closes the request's time line. Prints the median time of each milestone after the send and
the median gap between consecutive milestones.

    orca serve --model .cache/demo-llama &        # prints its HTTP and NATS URLs
    python benchmarks/hop_latency.py --http http://127.0.0.1:8000 --nats nats://127.0.0.1:4222

The subscriber runs on the machine it measures: each of its callbacks costs the control plane a
few tens of microseconds, so the absolute times here are a little above an unobserved run's. It
binds itself to the control plane's cores (`--cpus`; by default those `orca serve` gives the control
plane on this machine with one worker): on the worker's core its callbacks wait for the forward pass
the step message starts, and the step seems to leave the master milliseconds late (2026-12-04, NATS,
admit to step 4.4-5.3 ms with the observer on the worker's core, 1.3-1.5 ms on the control plane's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import aiohttp
import nats

from services.cpu_binding import available_cpus, bind_this_process, plan_cpu_layout

HOPS = [
    ("generate", lambda s: s == "orca.v1.generate"),
    ("admission.submit", lambda s: s == "orca.v1.admission.submit"),
    ("engine.admit", lambda s: s.startswith("orca.v1.engine.") and s.endswith(".admit")),
    ("engine.step", lambda s: s.startswith("orca.v1.engine.") and s.endswith(".step")),
    ("engine.result", lambda s: s.startswith("orca.v1.engine.") and s.endswith(".result")),
    ("detok", lambda s: s.startswith("orca.v1.detok.")),
    ("event", lambda s: s.startswith("_INBOX.")),
]


def hop_of(subject: str) -> str | None:
    return next((name for name, matches in HOPS if matches(subject)), None)


class Recorder:
    """First arrival of each hop since `begin()`."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}

    def begin(self) -> None:
        self.first = {}

    async def on_message(self, msg) -> None:
        now = time.perf_counter()
        hop = hop_of(msg.subject)
        if hop is not None:
            self.first.setdefault(hop, now)


async def one_http(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    first = 0.0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if first == 0.0 and line.startswith(b"data: {"):
                first = time.perf_counter()
    return first


async def one_nats(nc, prompt: list[int], max_tokens: int) -> float:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("orca.v1.generate", json.dumps({
        "id": uuid.uuid4().hex, "prompt_token_ids": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True}).encode(), reply=inbox)
    first = 0.0
    async for msg in sub.messages:
        if first == 0.0:
            first = time.perf_counter()
        if json.loads(msg.data).get("finish_reason"):
            break
    await sub.unsubscribe()
    return first


def control_plane_cpus() -> list[int]:
    """The cores `orca serve`'s default layout leaves the control plane here (one worker, the cores less one)."""
    cpus = available_cpus()
    layout = plan_cpu_layout(cpus, workers=1, threads=max(1, len(cpus) - 1))
    return list(layout.control) if layout else cpus


def parse_cpus(text: str) -> list[int] | None:
    if text == "auto":
        return control_plane_cpus()
    if text == "off":
        return None
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, off or a comma-separated list of cores") from None


async def main(args: argparse.Namespace) -> None:
    if args.cpus is not None and bind_this_process(args.cpus):
        print(f"observer and sender on cores {args.cpus}")
    recorder = Recorder()
    observer = await nats.connect(args.nats)
    if not args.unobserved:
        await observer.subscribe("orca.v1.>", cb=recorder.on_message)
        await observer.subscribe("_INBOX.>", cb=recorder.on_message)
    await observer.flush()
    sender = await nats.connect(args.nats)
    prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_len)]
    rows: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as session:
        model = args.model
        if args.transport == "http" and model is None:
            async with session.get(f"{args.http}/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
        for i in range(args.warmup + args.requests):
            recorder.begin()
            sent = time.perf_counter()
            if args.transport == "http":
                first = await one_http(session, args.http, model, prompt, args.max_tokens)
            else:
                first = await one_nats(sender, prompt, args.max_tokens)
            await asyncio.sleep(0.05)  # the observer's callbacks catch up
            if i >= args.warmup:
                rows.append({**{hop: (t - sent) * 1e3 for hop, t in recorder.first.items()},
                             "first token": (first - sent) * 1e3})
            await asyncio.sleep(args.gap)
    await sender.close()
    await observer.close()
    report(rows, args)


def report(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    order = [name for name, _ in HOPS] + ["first token"]
    print(f"{args.transport}: {len(rows)} requests, prompt {args.prompt_len} tokens; median ms after the send")
    previous = 0.0
    print(f"{'milestone':<18} {'at':>8} {'gap':>8}   (p10-p90 of at)")
    for name in order:
        times = [row[name] for row in rows if name in row]
        if not times:
            continue
        at = statistics.median(times)
        deciles = statistics.quantiles(times, n=10) if len(times) > 1 else [at] * 9
        print(f"{name:<18} {at:8.2f} {at - previous:8.2f}   ({deciles[0]:.2f}-{deciles[-1]:.2f})")
        previous = at


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=("http", "nats"), default="http")
    parser.add_argument("--http", default="http://127.0.0.1:8000")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--model", default=None, help="the served model name (default: the first of /v1/models)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--unobserved", action="store_true", help="no subscriber: the first token's time only")
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between requests")
    parser.add_argument("--cpus", type=parse_cpus, default="auto",
                        help="cores to run on, comma-separated; auto (default): the control plane's; off: unbound")
    asyncio.run(main(parser.parse_args()))
