"""Stream a generation over core NATS from a running `orca serve`.

    python examples/nats_producer.py --nats-url nats://127.0.0.1:4222 --prompt "def main():"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import nats


async def generate(nats_url: str, body: dict, timeout_s: float = 60.0) -> dict:
    nc = await nats.connect(nats_url)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("orca.v1.generate", json.dumps(body).encode(), reply=inbox)
    try:
        while True:
            event = json.loads((await sub.next_msg(timeout=timeout_s)).data)
            print(event["text"], end="", flush=True)
            if event["finish_reason"] is not None:
                print()
                return event
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    body = {"id": uuid.uuid4().hex, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
    final = asyncio.run(generate(args.nats_url, body))
    print(json.dumps({k: final[k] for k in ("finish_reason", "usage") if k in final}))


if __name__ == "__main__":
    main()
