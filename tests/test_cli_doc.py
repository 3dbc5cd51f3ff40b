"""docs/cli.md is the command line's reference: written from the parsers (`python -m blockspec.cli_doc`), it
shows every flag of every subcommand and none that is gone."""

from __future__ import annotations

from pathlib import Path

from blockspec.cli import build_parser
from blockspec.cli_doc import documented_flags, markdown, parser_flags

DOC = Path(__file__).parent.parent / "docs" / "cli.md"
REGENERATE = "regenerate it: python -m blockspec.cli_doc > docs/cli.md"


def test_every_flag_is_documented_and_no_other():
    shown, real = documented_flags(DOC.read_text()), parser_flags(build_parser())
    assert shown.keys() == real.keys(), f"docs/cli.md's commands differ from the parser's; {REGENERATE}"
    for command, flags in real.items():
        missing, gone = flags - shown[command], shown[command] - flags
        assert not missing, f"{command}: docs/cli.md does not show {sorted(missing)}; {REGENERATE}"
        assert not gone, f"{command}: docs/cli.md shows {sorted(gone)}, which no longer exist; {REGENERATE}"


def test_the_file_is_what_the_parsers_write():
    assert DOC.read_text() == markdown(build_parser()), f"docs/cli.md is stale; {REGENERATE}"


def test_a_row_reads_its_default_and_meaning():
    text = markdown(build_parser())
    assert "| `--port PORT` | 8000 | TCP port to listen on |" in text
    assert ("| `--model-path DIR` | embedded SmolLM2-135M-Instruct | HF target folder |") in text
    assert "| `--no-ui` | the page is served | do not serve the chat page at / (the API is the same" in text
    assert "**sampling**" in text and "**engine**" in text
