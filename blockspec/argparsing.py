"""The command line's argparse pieces, shared by every subcommand's registration: help that states each
flag's default, and usage errors in one line."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if isinstance(action, argparse._StoreFalseAction):  # `--no-x`: "default: on" would read as its own
            return f"{text} (default: not given)"
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)"


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """A subcommand description laid out as written."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command and where its help is."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message}. See `{self.prog} --help`.\n")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]):
        # argparse drops a lone "--" from a flag's values (`--seed=--` would leave a list, not a value)
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {action.option_strings[0]}: expected a value, got '--'")
        return super()._get_values(action, arg_strings)
