"""docs/api.md is the API's reference: each of its tables names exactly what the code has (LLM's members,
the config and sampling fields, the outputs, the errors; the server's routes, the request fields it reads,
the response fields it adds, its status codes). A name added or removed on either side fails here."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

import blockspec
import blockspec.errors as errors
from blockspec.config import EngineConfig
from blockspec.engine.stats import RequestStats
from blockspec.outputs import RequestOutput, StreamDelta
from blockspec.sampling_params import SamplingParams
from tests.test_server import folders, make_llm  # noqa: F401 - fixtures

ROOT = Path(blockspec.__file__).parent
SERVER = ROOT / "server"
DOC = ROOT.parent / "docs" / "api.md"
OPENAI_CARD = {"id", "object", "created", "owned_by"}
OPENAI_USAGE = {"prompt_tokens", "completion_tokens", "total_tokens"}


def doc_tables() -> dict[str, set[str]]:
    """Heading -> the names its table's first column shows (each backticked name; a call's name before
    its parentheses; a route whole)."""
    tables: dict[str, set[str]] = {}
    heading = None
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
            tables[heading] = set()
        elif heading and line.startswith("| `"):
            for span in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                tables[heading].add(span if re.match(r"[A-Z]+ /", span) else re.match(r"[\w.]+", span)[0])
    return tables


def documented(heading: str) -> set[str]:
    tables = doc_tables()
    assert heading in tables, f"docs/api.md has no section '### {heading}'"
    return tables[heading]


def same(heading: str, code: set[str]) -> None:
    shown = documented(heading)
    assert not code - shown, f"docs/api.md '{heading}' does not show {sorted(code - shown)}"
    assert not shown - code, f"docs/api.md '{heading}' shows {sorted(shown - code)}, which the code lacks"


def public_members(cls: type) -> set[str]:
    """A class's public methods and properties, and the attributes its methods set on self."""
    path = ROOT / (cls.__module__.split(".", 1)[1].replace(".", "/") + ".py")
    tree = next(n for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) \
                        and item.value.id == "self":
                    names.add(item.attr)
    return {n for n in names if not n.startswith("_")}


def test_python_api():
    same("`LLM`", public_members(blockspec.LLM))
    same("`EngineConfig`", {f.name for f in fields(EngineConfig)})
    same("`SamplingParams`", {f.name for f in fields(SamplingParams)})
    outputs = {f.name for f in fields(RequestOutput)}
    outputs |= {n for n, v in vars(RequestOutput).items() if isinstance(v, property)}
    same("`RequestOutput`", outputs)
    same("`StreamDelta`", {f.name for f in fields(StreamDelta)})
    same("Errors", {n for n, v in vars(errors).items()
                    if isinstance(v, type) and issubclass(v, errors.BlockspecError)})


def body_reads(path: Path) -> set[str]:
    """The request fields a server module reads: body.get("x"), body["x"], "x" in body, and the checkers
    _int / _number / _bool(body, "x"); `options` is the body's stream_options."""
    def owner(node: ast.AST) -> str | None:
        text = ast.unparse(node)
        return "" if text == "body" else "stream_options." if text.startswith("options") else None

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        key = prefix = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                key, prefix = node.args[0].value, owner(node.func.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1 \
                and node.func.id in ("_int", "_number", "_bool") and isinstance(node.args[1], ast.Constant):
            key, prefix = node.args[1].value, owner(node.args[0])
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key, prefix = node.slice.value, owner(node.value)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and isinstance(node.ops[0], ast.In):
            key, prefix = node.left.value, owner(node.comparators[0])
        if isinstance(key, str) and prefix is not None:
            names.add(prefix + key)
    return {n for n in names if not any(m.startswith(n + ".") for m in names)}


def test_request_fields():
    from blockspec.server import token_sources

    every = body_reads(SERVER / "app.py")  # model
    same("Request fields: `/v1/completions`, `/v1/chat/completions`",
         every | body_reads(SERVER / "protocol.py") | {token_sources.REQUEST_FIELD})
    same("Request fields: `/tokenize`, `/detokenize`", every | body_reads(SERVER / "tokenize.py"))


def test_status_codes():
    codes = {405}  # starlette's, for a route called with another method
    for path in SERVER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and ast.unparse(node.func) in ("APIError", "super().__init__") \
                    and isinstance(node.args[0].value, int):
                codes.add(node.args[0].value)
    shown = {int(m) for m in re.findall(r"^\| (\d{3}) \|", DOC.read_text(), re.M)}
    assert shown == codes, (sorted(shown), sorted(codes))


@pytest.fixture(scope="module")
def app_client(folders):  # noqa: F811 - the fixture
    from fastapi.testclient import TestClient

    from blockspec.server.app import create_app

    with TestClient(create_app(make_llm(folders, max_model_len=64))) as client:
        yield client


def test_routes(app_client):
    routes = set()
    for route in app_client.app.routes:
        path = re.sub(r":\w+}", "}", route.path)
        path = "/ui/*" if path.startswith("/ui/") else path
        routes |= {f"{method} {path}" for method in route.methods - {"HEAD"}}
    same("Routes", routes)


def test_response_fields(app_client):
    from blockspec.server.responses import extension, usage
    from blockspec.server.token_sources import attach

    card = app_client.get("/v1/models").json()["data"][0]
    details = {f"usage.{k}.{inner}" for k, v in usage(3, 2, 1).items() if k not in OPENAI_USAGE
               for inner in v}
    added = {"blockspec", *details, *attach({}, []), *(set(card) - OPENAI_CARD)}
    same("Response fields beyond OpenAI's", added)
    same("The `blockspec` field", set(extension(RequestStats(), "DFLASH", 4)))
    same("`GET /health`", set(app_client.get("/health").json()))
    same("`GET /stats`", set(app_client.get("/stats").json()))
