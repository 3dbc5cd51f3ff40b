"""Where blockspec keeps what it makes once per machine: the converted default model, training caches."""

from __future__ import annotations

import os
from pathlib import Path


def blockspec_home() -> Path:
    """Cache root: $BLOCKSPEC_HOME, or ~/.cache/blockspec."""
    env = os.environ.get("BLOCKSPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blockspec"
