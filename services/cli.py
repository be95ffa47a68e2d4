"""The `orca` command line. Flag names follow vLLM's where vLLM has the same knob."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared import env
from shared.config import (DTYPES, KERNEL_BACKENDS, SCHEDULER_POLICIES, CacheConfig, EngineConfig, ModelConfig,
                           ParallelConfig, SchedulerConfig)


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=model_required,
                   help="Hugging Face checkpoint directory" + ("" if model_required else " (default: the demo model)"))
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--scheduler", default="orca", choices=SCHEDULER_POLICIES, help="iteration scheduling policy")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one iteration")
    g.add_argument("--enable-chunked-prefill", action="store_true", help="split long prompts across iterations")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next iteration while the worker runs this one (one worker; default on)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--kv-cache-tokens", type=int, default=65536, help="KV cache capacity in token slots")
    g.add_argument("--block-size", type=int, default=16, help="KV slots per block (1 = Orca's per-slot accounting)")
    g.add_argument("--enable-prefix-caching", action="store_true", help="share KV of identical prompt prefixes")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    g.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS,
                   help="auto: Triton kernels on CUDA, the compiled C attention on CPU (torch without a C compiler)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="--enforce-eager: the plain torch step; --no-enforce-eager: compile it (torch.compile) "
                        "on any device; default: compile on CUDA only")
    add_chat_template_arg(g)
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="workers per pipeline stage")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages (as many batches in flight)")
    env.apply_engine_env(parser)  # ORCA_<FIELD> variables become these flags' defaults (shared/env.py)


def add_chat_template_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The one flag that the engine, the tokenizer service and the gateway share (each renders chats).
    Its ORCA_CHAT_TEMPLATE variable applies where the parser calls `env.apply_engine_env`."""
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, as a file or the template text, rendered instead of the "
                             "checkpoint's (vLLM's flag)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = str(Path(args.model).expanduser())
    return EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          seed=args.seed, kernel_backend=args.kernel_backend,
                          enforce_eager=args.enforce_eager, chat_template=args.chat_template),
        scheduler=SchedulerConfig(policy=args.scheduler, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  async_scheduling=args.async_scheduling),
        cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size,
                          enable_prefix_caching=args.enable_prefix_caching),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size),
    )


def cmd_make_demo_model(args: argparse.Namespace) -> int:
    from model.demo import make_demo_model

    path = make_demo_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote a {args.size} {args.arch} checkpoint to {path}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.batch_job import run_batch
    from engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    check_chat_template(config)
    engine = LLMEngine(config, stream_text=False)
    source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    sink = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        with source, sink:
            counts = run_batch(engine, source, sink, progress=not args.no_progress)
    finally:
        engine.close()  # worker processes under -tp/-pp
    print(f"{counts['requests']} requests, {counts['errors']} errors -> {args.output}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from services.logs import setup_logging
    from services.serve import resolve_model, serve

    setup_logging(args.log_level)
    resolve_model(args)
    config = engine_config_from_args(args)
    check_chat_template(config)
    return serve(args, config)


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

    from bench.cli import add_bench_parsers

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
