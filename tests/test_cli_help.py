"""Help and a light start: every flag's help says what it does and its default; `--version` and
`blockspec.__version__`; `import blockspec` and `blockspec --help` load no torch; imports flow one way,
around no circle."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import blockspec
from blockspec.cli import build_parser, subcommand_parser

ROOT = Path(blockspec.__file__).parent


def test_every_flag_says_what_it_does_and_its_default():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, sub in subs.choices.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert len(text) > 10, (command, action.option_strings)
            assert "default" in text or "required" in text, (command, action.option_strings, text)


def test_version():
    assert blockspec.__version__ == version("blockspec")
    out = subprocess.run([sys.executable, "-m", "blockspec", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"blockspec {blockspec.__version__}"


def test_import_and_help_load_no_torch():
    code = ("import sys, blockspec; from blockspec import SamplingParams, BlockspecError; "
            "from blockspec.cli import build_parser; build_parser().format_help(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("blockspec"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("blockspec"))
    return names


def test_imports_flow_one_way():
    """No module imports one above it: layers <- models <- engine <- speculative <- the rest; the base
    modules import no package; ranks (tensor parallelism) does not import llm, which starts it."""
    order = ["layers", "models", "engine", "speculative"]
    for path in ROOT.rglob("*.py"):
        package = path.relative_to(ROOT).parts[0] if len(path.relative_to(ROOT).parts) > 1 else None
        if package not in order:
            continue
        for name in imports_of(path):
            other = name.split(".")[1] if name.count(".") else None
            if other in order:
                assert order.index(other) <= order.index(package), (path, name)
    for base in ("errors", "device", "home", "sampling_params", "config", "distributed", "paths", "version"):
        for name in imports_of(ROOT / f"{base}.py"):
            upper = order + ["llm", "server", "bench", "train", "terminal"]
            assert name.split(".")[1] not in upper, (base, name)
    assert "blockspec.llm" not in imports_of(ROOT / "ranks.py")


def help_of(*command: str) -> str:
    parser = build_parser()
    return (parser if not command else subcommand_parser(parser, command[0])).format_help()


def test_help_reads_as_meant():
    """`blockspec --help` says what runs by default; `--no-ui` does not read as if the page were off;
    eval-draft's table goes to stdout, as its help says."""
    top = " ".join(help_of().split())
    assert "defaults, for every command: the embedded SmolLM2-135M-Instruct" in top
    assert "COMMAND --help` lists a command's flags, each with its default" in top
    serve = " ".join(help_of("serve").split())
    assert "--no-ui do not serve the chat page at / (default: the page is served;" in serve
    assert "(default: on)" not in serve
    evaluate = " ".join(help_of("eval-draft").split())
    assert "only the table, on stdout" in evaluate and "stderr" not in evaluate


def module_imports(path: Path) -> set[str]:
    """The blockspec modules a file imports at its top level (type-checking imports too; not those inside
    functions, which run later), as dotted names of files."""
    tree = ast.parse(path.read_text())
    nodes = list(tree.body)
    nodes += [n for node in tree.body if isinstance(node, ast.If) for n in node.body]
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("blockspec"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from blockspec.x import module`
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("blockspec"))
    return names


def test_no_import_circles():
    """No file imports one that imports it back, directly or around a loop."""
    files = {".".join(("blockspec", *p.relative_to(ROOT).with_suffix("").parts)): p
             for p in ROOT.rglob("*.py")}
    graph = {name: {m for m in module_imports(path) if m in files and m != name}
             for name, path in files.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        assert name not in trail, f"import circle: {' -> '.join(trail[trail.index(name):] + [name])}"
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
