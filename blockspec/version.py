"""The installed blockspec's version (pyproject.toml's, as the package metadata records it)."""

from __future__ import annotations

import functools


@functools.cache
def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("blockspec")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
