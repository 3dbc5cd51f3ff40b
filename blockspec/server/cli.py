"""`blockspec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import socket

from blockspec.config import EngineConfig, add_model_args, add_serving_args
from blockspec.errors import BlockspecError


def register(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None,
                       help="model id in the API (default: the model folder name)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    add_serving_args(serve, default_running=16)
    add_model_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from blockspec.llm import LLM
    from blockspec.server.app import create_app

    config = EngineConfig.from_args(args)
    if not 0 < args.port < 65536:
        raise BlockspecError(f"--port={args.port} must be in 1..65535.")
    try:  # fail before loading the model if the address is taken
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as exc:
        raise BlockspecError(f"Cannot listen on {args.host}:{args.port} ({exc.strerror}); "
                             f"pick another --port.") from exc
    llm = LLM(config)
    app = create_app(llm, api_key=args.api_key, served_model_name=args.served_model_name)
    scheduler = app.state.engine.scheduler
    if scheduler.max_total_tokens < llm.max_model_len - 1 + scheduler.width:
        print(f"warning: the KV budget ({scheduler.max_total_tokens} tokens) is below one full-context "
              f"request ({llm.max_model_len - 1 + scheduler.width}); longer requests will be refused "
              f"with 400.", flush=True)
    print(f"blockspec serving {app.state.model_name} ({llm.speculative_algorithm}, block {llm.block_size}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
