"""`blockspec` command line: generate here; bench, bench-serving, serve, train-draft and eval-draft register
themselves from their packages. Flag names follow SGLang's."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from blockspec.config import EngineConfig, add_model_args
from blockspec.errors import BlockspecError
from blockspec.sampling_params import add_sampling_args, sampling_from_args

# Each has register(sub), which adds its subcommands.
SUBCOMMANDS = ("blockspec.bench.cli", "blockspec.server.cli", "blockspec.train.cli")
DEMO_PROMPT = "Write a Python function that checks whether a number is prime."


def run_generate(args: argparse.Namespace) -> None:
    from blockspec.llm import LLM

    llm = LLM(EngineConfig.from_args(args))
    params = sampling_from_args(args)
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    else:
        out = llm.generate(prompt, params)[0]
    if args.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": out.num_prompt_tokens,
            "num_output_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "speculative_algorithm": out.speculative_algorithm, "block_size": out.block_size,
            **out.stats.summary(), "time_to_first_token_s": round(out.time_to_first_token_s, 4),
            "decode_tokens_per_s": round(out.decode_tokens_per_s, 3),
        }))
        return
    print(out.text)
    stats = out.stats
    note = "" if out.speculative_algorithm == "DFLASH" else " (plain decoding: no DFlash draft in use)"
    steps = ""
    if stats.plain_steps:
        steps = f" over {len(stats.accept_lengths)} DFlash steps + {stats.plain_steps} plain steps"
    if stats.lookup_accept_lengths:
        steps += (f"; {len(stats.lookup_accept_lengths)} prompt-lookup steps "
                  f"(tau {stats.lookup_mean_accept_length:.2f})")
    print(
        f"\n[{out.speculative_algorithm}{note}] {len(out.token_ids)} tokens, "
        f"tau={out.mean_accept_length:.2f}{steps}, {out.decode_tokens_per_s:.1f} tok/s decode, "
        f"TTFT {out.time_to_first_token_s:.2f}s",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec",
                                     description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_sampling_args(gen)
    add_model_args(gen)
    gen.set_defaults(func=run_generate)

    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
