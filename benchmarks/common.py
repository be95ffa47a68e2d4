"""What the in-process benchmark scripts share: the engine flags, the engine built from them, the summary.

The engine flags are `orca generate`'s own (`shared.flags.add_engine_args`, vLLM's names), so a
benchmark and the command it measures take the same flags with the same meaning; each script
only sets its own defaults. ORCA_<FIELD> variables still win over those defaults, and a flag over
both, as for `orca generate`. Import this after `shared.env.prefer_passive_openmp()` where a
script calls it: it imports the engine, and so torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec

from engine.llm_engine import LLMEngine
from services.cli import engine_config_from_args
from shared.flags import add_engine_args


def engine_parser(description: str | None, num_requests: int, **defaults: Any) -> argparse.ArgumentParser:
    """A parser with the engine flags and --num-requests; `defaults`: this script's defaults of engine
    flags, by config field (kv_cache_tokens=131072); --dtype defaults to float32 unless given here."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, defaults={"dtype": "float32", **defaults})  # the ORCA_ variables override these
    parser.add_argument("--num-requests", type=int, default=num_requests)
    return parser


def make_engine(args: argparse.Namespace, policy: str | None = None, stream_text: bool = False,
                max_batches_in_flight: int | None = None) -> LLMEngine:
    """The engine the flags describe; `policy` replaces --scheduler's (a script that runs several side by side).
    stream_text=False: as `orca generate` runs it (texts decoded once, at each request's end)."""
    config = engine_config_from_args(args)
    if policy is not None:
        config = msgspec.structs.replace(config, scheduler=msgspec.structs.replace(config.scheduler, policy=policy))
    return LLMEngine(config, stream_text=stream_text, max_batches_in_flight=max_batches_in_flight)


def write_summary(summary: Any, out: str | None) -> None:
    """Print the summary as indented JSON on stdout and, given a path (--out), write the same JSON there."""
    print(json.dumps(summary, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)
