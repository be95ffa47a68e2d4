"""Stream a generation over core NATS from a running `orca serve`.

    python examples/nats_producer.py --nats-url nats://127.0.0.1:4222 --prompt "def main():"

The stream arrives whole through a NATS restart, a cluster failover or a tokenizer's death:
`shared.client.generate` follows the README's client rule (events in `seq` order, a replay from
`orca.v1.generate.replay` after a gap, a silence or a reconnect, a resend when nobody holds the
request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import nats

from shared.client import generate


async def stream(nats_url: str, body: dict, timeout_s: float = 120.0) -> dict:
    # One server, or a cluster's servers comma-separated: the client fails over between them.
    nc = await nats.connect(servers=nats_url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    try:
        events = await generate(nc, body, timeout_s=timeout_s,
                                on_event=lambda event: print(event["text"], end="", flush=True))
        print()
        return events[-1]
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    body = {"id": uuid.uuid4().hex, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
    final = asyncio.run(stream(args.nats_url, body))
    print(json.dumps({k: final[k] for k in ("finish_reason", "error", "usage") if k in final}))


if __name__ == "__main__":
    main()
