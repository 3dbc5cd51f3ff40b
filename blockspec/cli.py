"""`blockspec` command line: each package registers its subcommands (generate and chat: terminal/; bench and
bench-serving: bench/; serve: server/; train-draft and eval-draft: train/). Flag names follow SGLang's.

Nothing heavy is imported to build the parser, so `--help`, `--version` and a mistyped flag answer at once.
A user's mistake ends in one line on stderr and exit status 2, never a traceback: argparse's own errors
(`Parser.error`) and every `BlockspecError`, whose messages name the flags (`errors.cli_flags`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from blockspec.argparsing import Parser, RawHelpFormatter
from blockspec.errors import BlockspecError, cli_flags

# Each has register(sub), which adds its subcommands.
SUBCOMMANDS = ("blockspec.terminal.cli", "blockspec.bench.cli", "blockspec.server.cli", "blockspec.train.cli")
EPILOG = """defaults, for every command: the embedded SmolLM2-135M-Instruct target and its
shipped DFlash draft (block size: the draft's own), greedy sampling, adaptive
speculation and prompt lookup on; CUDA when visible, else the CPU with the
threads other processes leave free.

`blockspec COMMAND --help` lists a command's flags, each with its default;
docs/cli.md lists every command's."""
# Settings whose name differs from the dest of the flag that sets them.
SETTING_DESTS = {"max_tokens": "max_new_tokens"}


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Setting name -> the flag that sets it, for a subcommand's parser (error messages name flags)."""
    flags = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in ("help", "version"):
            flags[action.dest] = longs[0]
    flags.update({name: flags[dest] for name, dest in SETTING_DESTS.items() if dest in flags})
    return flags


def build_parser() -> Parser:
    from blockspec.version import version

    parser = Parser(prog="blockspec", description="DFlash block-diffusion speculative decoding",
                    epilog=EPILOG, formatter_class=RawHelpFormatter)
    parser.add_argument("--version", action="version", version=f"blockspec {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices[name]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with cli_flags(flag_names(subcommand_parser(parser, args.command))):
            args.func(args)
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`blockspec generate ... | head -1`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
