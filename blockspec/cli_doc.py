"""docs/cli.md, written from the argparse parsers themselves, so the reference cannot drift from the command
line: every subcommand, its flags grouped as `--help` groups them, each with its default and its meaning.

`python -m blockspec.cli_doc > docs/cli.md` writes it; tests/test_cli_doc.py fails when the file and the
parsers disagree.
"""

from __future__ import annotations

import argparse
import re

HEADER = """# blockspec command line

Every subcommand and every flag, as `blockspec COMMAND --help` shows them, grouped the same way. Written
from the parsers by `python -m blockspec.cli_doc > docs/cli.md` (a test fails when this file and the
command line disagree). Flag names follow SGLang's; where a flag has aliases, all are listed. A setting
with no default value ("unset") is chosen as its meaning says. Every value is checked before anything
loads; a mistake prints one line naming the flag and exits with status 2.
"""
DEFAULT_IN_HELP = re.compile(r"\bdefault:?\s+")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subs.choices)


def summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Subcommand -> its one-line help, as `blockspec --help` lists it."""
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help or "" for choice in subs._choices_actions}


def shown(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS and action.dest != "help"


def flag_cell(action: argparse.Action) -> str:
    """All of a flag's names (or a positional's), with the value it takes."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    value = ""
    if action.nargs != 0:
        if action.metavar is not None:
            value = f" {action.metavar}"
        elif action.choices is not None:
            value = " {" + ",".join(str(c) for c in action.choices) + "}"
        else:
            value = f" {action.dest.upper()}"
        if action.nargs in ("+", "*"):
            value += " ..."
    return " / ".join(f"`{name}{value}`" for name in action.option_strings)


def split_default(text: str) -> tuple[str | None, str]:
    """A help text's own "default: X" clause (X, as its author put it) and the text without it."""
    found = DEFAULT_IN_HELP.search(text)
    if not found:
        return None, text
    start, depth, end = found.start(), 0, len(text)
    for i in range(found.end(), len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")" and depth:
            depth -= 1
        elif text[i] in ");" and not depth:
            end = i
            break
    value = text[found.end():end].strip()
    before, after = text[:start].rstrip(), text[end:]
    if before.endswith("(") and after.startswith(")"):
        rest = before[:-1].rstrip() + after[1:]
    elif before.endswith("(") and after.startswith(";"):
        rest = before + after[1:].lstrip()
    elif after.startswith(";"):
        rest = before + " " + after[1:].lstrip()
    else:
        rest = before.rstrip(";,") + after
    return value, rest.strip()


def default_cell(action: argparse.Action, text: str) -> str:
    """The default as the help words it, else the value argparse holds."""
    if getattr(action, "required", False) or (not action.option_strings and action.nargs not in ("?", "*")):
        return "required"
    said, _ = split_default(text)
    if said:
        return said
    if action.default is argparse.SUPPRESS:
        return ""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "not given"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.default is None:
        return "unset"
    if isinstance(action.default, (list, tuple)):
        return " ".join(str(v) for v in action.default)
    return str(action.default)


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return " ".join(text.split()).replace("|", "\\|")


def row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = help_text(parser, action)
    return f"| {flag_cell(action)} | {default_cell(action, text)} | {split_default(text)[1]} |"


def group_table(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> list[str]:
    actions = [a for a in group._group_actions if shown(a)]
    if not actions:
        return []
    rows = [f"**{group.title}**", "", "| flag | default | meaning |", "|---|---|---|"]
    rows += [row(parser, a) for a in actions]
    return rows + [""]


def command_section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    rows = [f"## `{name}`", "", summary[:1].upper() + summary[1:] + ".", ""]
    for group in parser._action_groups:
        rows += group_table(parser, group)
    return rows


def markdown(parser: argparse.ArgumentParser) -> str:
    rows = [HEADER, "## `blockspec`", ""]
    rows += [f"- `{name}`: {text}" for name, text in summaries(parser).items()]
    rows += ["", " ".join((parser.epilog or "").split()), ""]
    for group in parser._action_groups:
        rows += group_table(parser, group)
    helps = summaries(parser)
    for name, sub in subcommands(parser).items():
        rows += command_section(f"blockspec {name}", helps.get(name, ""), sub)
    return "\n".join(rows).rstrip() + "\n"


def documented_flags(text: str) -> dict[str, set[str]]:
    """Section ("blockspec", "blockspec serve", ...) -> the flags its tables show, read back from a file."""
    flags: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("## `"):
            section = line[4:].rstrip("`")
            flags[section] = set()
        elif section and line.startswith("| `"):
            cell = line.split(" | ")[0][2:]
            flags[section].update(re.findall(r"`(-[-\w]+)", cell))
    return flags


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    def of(p: argparse.ArgumentParser) -> set[str]:
        return {o for a in p._actions if shown(a) for o in a.option_strings}

    flags = {"blockspec": of(parser)}
    flags.update({f"blockspec {name}": of(sub) for name, sub in subcommands(parser).items()})
    return flags


if __name__ == "__main__":
    from blockspec.cli import build_parser

    print(markdown(build_parser()), end="")
