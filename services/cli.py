"""The `orca` command line. Flag names follow vLLM's where vLLM has the same knob."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import stat
import sys
from pathlib import Path

from shared import env, flags
from shared.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Every engine flag (shared/flags.py builds them from shared/config.py), with the ORCA_<FIELD>
    variables as their defaults; `model_required=False`: without --model, the demo model."""
    if model_required:
        flags.add_engine_args(parser)
    else:
        flags.add_engine_args(parser, defaults={"model": None},
                              helps={"model": "Hugging Face checkpoint directory (default: the demo model)"})


def add_chat_template_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The one flag that the engine, the tokenizer service and the gateway share (each renders chats).
    Its ORCA_CHAT_TEMPLATE variable applies where the parser calls `env.apply_engine_env`."""
    flags.add_flags(parser, ["chat_template"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of `add_engine_args`' flags, with `~` in --model expanded."""
    return flags.engine_config_from_args(args, model=str(Path(args.model).expanduser()))


def cmd_make_demo_model(args: argparse.Namespace) -> int:
    from model.demo import make_demo_model

    try:
        path = make_demo_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    except OSError as exc:  # a folder it cannot make or write: one line
        raise ValueError(f"cannot write a checkpoint to {args.dir}: {exc.strerror or exc}") from None
    print(f"wrote a {args.size} {args.arch} checkpoint to {path}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    where = "stdout" if args.output == "-" else args.output
    state: dict = {}
    try:
        return _generate(args, state)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        job = state.get("job")
        if job is not None and job.started:
            print(f"orca: interrupted: {job.written} of {job.total} records written to {where} "
                  "(input order, up to the first unfinished line)", file=sys.stderr)
        else:
            left = "" if args.output == "-" else f", {where} left as it was"
            print(f"orca: interrupted before the run started: nothing written{left}", file=sys.stderr)
        return 130


def _generate(args: argparse.Namespace, state: dict) -> int:
    """`orca generate`; `state["job"]`: the BatchJob once the model is loaded."""
    from engine.batch_job import BatchJob
    from engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    check_chat_template(config)
    with contextlib.ExitStack() as files:
        source = sys.stdin if args.input == "-" else files.enter_context(_open(args.input, "r", "--input"))
        if args.output != "-":
            _check_output(args.output)  # before the model loads; opened, and truncated, once the input is in

        def open_output():
            return sys.stdout if args.output == "-" else files.enter_context(_open(args.output, "w", "--output"))

        engine = LLMEngine(config, stream_text=False)
        try:
            state["job"] = job = BatchJob(engine, open_output, progress=not args.no_progress)
            counts = job.run(source)
        finally:
            engine.close()  # worker processes under -tp/-pp
    print(f"{counts['requests']} requests, {counts['errors']} errors -> {args.output}", file=sys.stderr)
    return 0


def _open(path: str, mode: str, flag: str):
    """A file of `orca generate`'s: a path it cannot use is one line, not a traceback."""
    try:
        return open(path, mode, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


def _check_output(path: str) -> None:
    """That --output can be written, checked before the model loads without creating or truncating it:
    a run that stops at start-up leaves an existing output as it was."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(f"--output {path}: {os.strerror(errno.ENOENT)}") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"--output {path}: {os.strerror(errno.EACCES)}") from None
        return
    except OSError as exc:
        raise ValueError(f"--output {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--output {path}: {os.strerror(errno.EISDIR)}")
    if not os.access(path, os.W_OK):
        raise ValueError(f"--output {path}: {os.strerror(errno.EACCES)}")


def cmd_serve(args: argparse.Namespace) -> int:
    from services.logs import setup_logging
    from services.serve import resolve_model, serve

    setup_logging(args.log_level)
    settings = flags.serve_config_from_args(args)  # a bad value stops here, before anything starts
    resolve_model(args)
    config = engine_config_from_args(args)
    check_chat_template(config)
    return serve(args, config, settings)


def check_chat_template(config: EngineConfig) -> None:
    """A --chat-template that names no file and is no template: one line now, not an error per request."""
    if config.model.chat_template is not None:
        from engine.tokenizer import load_chat_template

        load_chat_template(config.model.chat_template)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orca", description="orca-serve: an Orca-style LLM serving system")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("make-demo-model", help="write a small random checkpoint with a locally trained tokenizer")
    demo.add_argument("dir")
    demo.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    demo.add_argument("--size", default="tiny", choices=("tiny", "small"))
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_make_demo_model)

    gen = sub.add_parser("generate", help="serve a JSONL file of requests in process")
    add_engine_args(gen)
    gen.add_argument("--input", required=True, help="JSONL requests ('-' for stdin)")
    gen.add_argument("--output", required=True, help="JSONL results ('-' for stdout)")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    gen.set_defaults(func=cmd_generate)

    from services.serve import add_serve_args

    srv = sub.add_parser("serve", help="run the services: NATS, Ray, engines, tokenizer, admission")
    add_engine_args(srv, model_required=False)
    add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)

    from loadtest.cli import add_bench_parsers

    add_bench_parsers(sub)  # orca bench, orca simulate
    return parser


def main(argv: list[str] | None = None) -> int:
    env.prefer_passive_openmp()  # before anything imports torch; children (services, Ray workers) inherit it
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # configuration errors: one clear line, no traceback
        print(f"orca: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
