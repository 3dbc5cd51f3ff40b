"""Errors users can act on. Every one is a ValueError whose message names the bad value and the fix."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar


class BlockspecError(ValueError):
    """Base class: a configuration or input problem the user can fix."""


class ModelLoadError(BlockspecError):
    """A checkpoint folder, config or weight file is missing, malformed or inconsistent."""


class DraftConfigError(BlockspecError):
    """The DFlash draft configuration (mask token, layer ids, block size, shapes) is invalid."""


class RequestError(BlockspecError):
    """A generation request (prompt, sampling parameters, lengths) is invalid."""


# ---- naming settings in messages ------------------------------------------------------------------------
# While the command line runs a command, its flags by setting name (`cli_flags`); otherwise messages name the
# API's fields (LLM(...), SamplingParams(...), EngineConfig).
_flags: ContextVar[dict[str, str] | None] = ContextVar("blockspec_flags", default=None)


def setting(name: str, api: str | None = None) -> str:
    """A setting as the user spelled it: its command-line flag under `cli_flags`, else the API field name
    (or `api`, e.g. "resume=True" for a flag that takes no value)."""
    flags = _flags.get()
    if flags is not None and name in flags:
        return flags[name]
    return api or name


@contextlib.contextmanager
def cli_flags(flags: dict[str, str]) -> Iterator[None]:
    """Name settings by these flags (setting name -> flag) in the messages raised inside."""
    token = _flags.set(flags)
    try:
        yield
    finally:
        _flags.reset(token)
