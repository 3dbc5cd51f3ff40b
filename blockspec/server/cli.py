"""`blockspec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

from blockspec.config import EngineConfig
from blockspec.engine_flags import add_model_args, add_serving_args
from blockspec.errors import BlockspecError, cli_flags

DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024  # blockspec.server.app's default (not imported: fastapi is slow)
API_KEY_ENV = "BLOCKSPEC_API_KEY"


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $BLOCKSPEC_API_KEY, else None (no auth)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise BlockspecError("Give the API key once: --api-key or --api-key-file, not both.")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BlockspecError(f"--api-key-file {args.api_key_file}: cannot read it ({exc}).") from exc
        key = lines[0].strip() if lines else ""
    if key is None:
        key = os.environ.get(API_KEY_ENV) or None
    if key is not None and (not key or not key.isprintable() or not key.isascii() or " " in key):
        raise BlockspecError("The API key must be non-empty printable ASCII without spaces.")
    return key


def register(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (visible in `ps`: prefer "
                            "--api-key-file or the BLOCKSPEC_API_KEY environment variable; default: no key, "
                            "or $BLOCKSPEC_API_KEY)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file (its first line; default: none)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                       help=f"largest request body accepted; larger ones get 413 "
                            f"(default {DEFAULT_MAX_REQUEST_BYTES})")
    serve.add_argument("--cors-allow-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="answer CORS requests from these browser origins ('*': any); default: CORS off")
    serve.add_argument("--shutdown-grace-seconds", type=float, default=10.0, metavar="S",
                       help="on SIGTERM, how long running requests may finish before they end with an error "
                            "(default 10)")
    serve.add_argument("--no-ui", dest="ui", action="store_false",
                       help="do not serve the chat page at / (default: the page is served; the API is the "
                            "same either way)")
    serve.add_argument("--served-model-name", default=None,
                       help="model id in the API (default: the model folder name)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="the server's and uvicorn's log detail (info: start-up, a throughput line while "
                            "busy, one line per request)")
    serve.add_argument("--log-interval", type=float, default=5.0, metavar="S",
                       help="seconds between throughput log lines while busy (running requests, tokens/s, "
                            "tau, KV use); 0: none")
    add_serving_args(serve, default_running=16)
    add_model_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from blockspec.llm import LLM
    from blockspec.server.app import create_app
    from blockspec.server.shutdown import GracefulServer

    config = EngineConfig.from_args(args)
    if not 0 < args.port < 65536:
        raise BlockspecError(f"--port={args.port} must be in 1..65535.")
    if args.max_request_bytes < 1024:
        raise BlockspecError(f"--max-request-bytes={args.max_request_bytes} must be at least 1024.")
    if not 0 <= args.shutdown_grace_seconds <= 3600:
        raise BlockspecError(f"--shutdown-grace-seconds={args.shutdown_grace_seconds} must be in [0, 3600].")
    if not 0 <= args.log_interval <= 86400:
        raise BlockspecError(f"--log-interval={args.log_interval} must be a number of seconds in [0, 86400] "
                             f"(0: no throughput lines).")
    key = api_key(args)
    try:  # fail before loading the model if the address is taken
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as exc:
        raise BlockspecError(f"Cannot listen on {args.host}:{args.port} ({exc.strerror}); "
                             f"pick another --port.") from exc
    llm = LLM(config)
    logging.getLogger("blockspec").setLevel(args.log_level.upper())  # the throughput lines are INFO
    app = create_app(llm, api_key=key, served_model_name=args.served_model_name,
                     max_request_bytes=args.max_request_bytes, cors_origins=args.cors_allow_origins,
                     log_interval=args.log_interval, chat_page=args.ui)
    scheduler = app.state.engine.scheduler
    if scheduler.max_total_tokens < llm.max_model_len - 1 + scheduler.width:
        print(f"warning: the KV budget ({scheduler.max_total_tokens} tokens) is below one full-context "
              f"request ({llm.max_model_len - 1 + scheduler.width}); longer requests will be refused "
              f"with 400.", flush=True)
    print(f"blockspec serving {app.state.model_name} ({llm.speculative_algorithm}, block {llm.block_size}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    if args.ui:
        print(f"chat page: http://{args.host}:{args.port}/", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    with cli_flags({}):  # a request's errors name its JSON fields (max_tokens), not this command's flags
        GracefulServer(config, app.state.engine, args.shutdown_grace_seconds).run()
