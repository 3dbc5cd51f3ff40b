"""`blockspec serve` (the OpenAI-compatible server) and `blockspec bench-serving` (throughput vs concurrency)."""

from __future__ import annotations

import argparse
import socket

from blockspec.errors import BlockspecError


def add_engine_args(p: argparse.ArgumentParser, default_running: int) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-running-requests", type=int, default=default_running,
                   help=f"requests decoded together, one KV slot each (default {default_running})")
    g.add_argument("--max-total-tokens", "--kv-budget-tokens", dest="max_total_tokens", type=int, default=None,
                   help="KV memory budget in tokens, shared by target and draft caches (each token is one row in "
                        "both); when running requests outgrow it the youngest is preempted and recomputed later "
                        "(default: every slot can hold a full-context request, so nothing is ever preempted)")
    g.add_argument("--prefill-tokens-per-step", type=int, default=None,
                   help="prompt tokens prefilled per engine step alongside decoding (default 512)")


def check_engine_args(args: argparse.Namespace) -> None:
    for flag, value in (("--max-running-requests", args.max_running_requests),
                        ("--max-total-tokens", args.max_total_tokens),
                        ("--prefill-tokens-per-step", args.prefill_tokens_per_step)):
        if value is not None and value < 1:
            raise BlockspecError(f"{flag}={value} must be >= 1.")


def register(sub) -> None:
    from blockspec.cli import add_model_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: the model folder name)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(serve, default_running=16)
    add_model_args(serve)
    serve.set_defaults(func=run_serve)

    from blockspec.bench.serving import register as register_bench_serving

    register_bench_serving(sub)


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from blockspec.cli import build_llm
    from blockspec.server.app import create_app

    check_engine_args(args)
    if not 0 < args.port < 65536:
        raise BlockspecError(f"--port={args.port} must be in 1..65535.")
    try:  # fail before loading the model if the address is taken
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as exc:
        raise BlockspecError(f"Cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port.") from exc
    llm = build_llm(args, max_num_seqs=args.max_running_requests)
    app = create_app(llm, api_key=args.api_key, served_model_name=args.served_model_name,
                     max_total_tokens=args.max_total_tokens, prefill_tokens_per_step=args.prefill_tokens_per_step)
    scheduler = app.state.engine.scheduler
    if scheduler.max_total_tokens < llm.max_model_len - 1 + scheduler.width:
        print(f"warning: the KV budget ({scheduler.max_total_tokens} tokens) is below one full-context request "
              f"({llm.max_model_len - 1 + scheduler.width}); longer requests will be refused with 400.", flush=True)
    print(f"blockspec serving {app.state.model_name} ({llm.speculative_algorithm}, block {llm.block_size}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
