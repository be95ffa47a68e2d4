"""python -m services.gateway --nats-url nats://... --model DIR [--host H] [--port P]

Runs the gateway's FastAPI app alone under uvicorn (no Ray needed), as docker-compose runs it
beside the other services; `orca serve` runs the same app as a Ray Serve deployment instead.
The API key comes from --api-key or ORCA_API_KEY.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli import add_chat_template_arg
from services.gateway.app import build_app
from services.gateway.state import GatewaySettings
from services.logs import setup_logging
from services.ports import port_number
from services.service_args import add_service_args
from shared import env


def model_problem(model: str) -> str | None:
    """Why the gateway cannot serve `model`, checked before uvicorn starts (a failed lifespan is a traceback)."""
    from engine.tokenizer import TOKENIZER_FILES
    from model.arch import load_arch_config

    path = Path(model)
    if not path.is_dir():
        return f"--model {model} is not a directory"
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return f"--model {model} has no tokenizer files"
    try:
        load_arch_config(path)
    except ValueError as exc:
        return str(exc)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway")
    add_service_args(parser, alive_file=None)
    parser.add_argument("--model", required=True, help="checkpoint directory (its tokenizer and config.json)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--api-key", default=env.api_key(), help="require 'Authorization: Bearer <key>' "
                        "(default: $ORCA_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    add_chat_template_arg(parser)
    env.apply_engine_env(parser)  # ORCA_CHAT_TEMPLATE (and ORCA_MODEL), as for the engine
    args = parser.parse_args()
    if problem := model_problem(args.model):
        parser.error(problem)
    setup_logging(args.log_level)
    settings = GatewaySettings(nats_url=args.nats_url, model=args.model, served_model_name=args.served_model_name,
                               api_key=args.api_key, chat_template=args.chat_template)
    import uvicorn

    app = build_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           access_log=False, timeout_graceful_shutdown=10))
    app.state.stopping = lambda: server.should_exit  # a signal while NATS does not answer stops the wait
    server.run()
    if not server.started:  # as uvicorn.run: the app failed to start
        sys.exit(3)


if __name__ == "__main__":
    main()
