"""python -m services.tokenizer --nats-url nats://... --model DIR"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from engine.tokenizer import load_tokenizer
from model.arch import load_arch_config
from services import liveness, parent_watch
from services.bus import run_service, stop_events_on_signals
from services.cli import add_chat_template_arg
from services.logs import setup_logging
from services.service_args import add_service_args, run_event_loop
from services.tokenizer.service import TokenizerService
from shared import env
from shared.flags import add_serve_flags

log = logging.getLogger("orca.tokenizer")

HOLD_LIMIT_S = 120.0
"""The longest a drained tokenizer keeps refusing while it waits for its second signal: if the
`orca serve` that started it died, nobody will send one."""


async def main(args: argparse.Namespace) -> None:
    parent_watch.start(args.parent_pid)  # first: it must work while NATS is unreachable too
    tokenizer = load_tokenizer(args.model, args.chat_template, control_plane=True)
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer files")
    vocab_size = load_arch_config(args.model).vocab_size
    drain_signal, exit_signal = stop_events_on_signals(2)

    async def start(nc):
        liveness.start(args.alive_file)
        service = TokenizerService(nc, tokenizer, vocab_size, model_name=Path(args.model).name)
        await service.start()

        async def stop() -> None:
            await service.drain(args.drain_timeout, cut_short=exit_signal)  # a second signal: end them now
            if args.drained_fd is not None:
                await hold_until_exit_signal(args.drained_fd, exit_signal)

        return stop

    await run_service("orca-tokenizer", args.nats_url, start, stop=drain_signal)


async def hold_until_exit_signal(drained_fd: int, exit_signal: asyncio.Event) -> None:
    """Say "drained" on `drained_fd`, then keep refusing new requests (the subscription stays) until
    the second signal: the supervisor stops what is behind this service first, and a request that
    arrives meanwhile gets the clear "shutting down" refusal, not NATS' "no responders"."""
    try:
        os.write(drained_fd, b"drained\n")
        os.close(drained_fd)
    except OSError as exc:  # the supervisor is gone: nobody will send the second signal
        log.warning("could not report the drain (%s); exiting", exc)
        return
    try:
        await asyncio.wait_for(exit_signal.wait(), HOLD_LIMIT_S)
    except asyncio.TimeoutError:
        log.warning("no exit signal %.0f s after the drain; exiting", HOLD_LIMIT_S)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.tokenizer")
    add_service_args(parser)
    parser.add_argument("--model", required=True)
    add_serve_flags(parser, ["drain_timeout"])
    parser.add_argument("--drained-fd", type=int, default=None,
                        help="(for a supervisor) after the drain write a line to this file descriptor and keep "
                             "refusing new requests until a second SIGTERM; without it, exit once drained")
    add_chat_template_arg(parser)
    env.apply_engine_env(parser)  # ORCA_CHAT_TEMPLATE (and ORCA_MODEL), as for the engine
    args = parser.parse_args()
    setup_logging(args.log_level)
    run_event_loop(main(args))
