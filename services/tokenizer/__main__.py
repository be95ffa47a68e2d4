"""python -m services.tokenizer --nats-url nats://... --model DIR"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from engine.tokenizer import load_tokenizer
from model.arch import load_arch_config
from services.bus import run_service
from services.logs import setup_logging
from services.tokenizer.service import TokenizerService


async def main(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer files")
    vocab_size = load_arch_config(args.model).vocab_size

    async def start(nc):
        service = TokenizerService(nc, tokenizer, vocab_size, model_name=Path(args.model).name)
        await service.start()
        return lambda: service.drain(args.drain_timeout)

    await run_service("orca-tokenizer", args.nats_url, start)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.tokenizer")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--model", required=True)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let requests in flight finish before ending them with an error")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    setup_logging(args.log_level)
    asyncio.run(main(args))
