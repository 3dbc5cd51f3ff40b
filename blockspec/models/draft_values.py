"""Reading one value of a draft's config.json: where it sits (`dflash_config` or top level), and the checks
every integer and number field shares. Each failure is a `DraftConfigError` naming the field and the fix."""

from __future__ import annotations

import math
from typing import Any, Callable

from blockspec.errors import DraftConfigError

FIX = "Fix the draft's config.json, or use the draft checkpoint trained for this target."
Warn = Callable[[str], None]


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_value(value: object, name: str, where: str, minimum: int = 1, fix: str = FIX) -> int:
    if not is_int(value):
        raise DraftConfigError(f"DFLASH {where}: invalid {name}={value!r} (a {type(value).__name__}); "
                               f"it must be an integer >= {minimum}. {fix}")
    if value < minimum:  # type: ignore[operator]
        kind = "positive" if minimum == 1 else f">= {minimum}"
        raise DraftConfigError(f"DFLASH {where}: {name}={value} must be {kind} (>= {minimum}). {fix}")
    return value  # type: ignore[return-value]


def positive_float(value: object, name: str, where: str, default: float) -> float:
    if value is None:
        return default
    try:
        number = (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                  else math.nan)
    except OverflowError:  # an int too big for a float
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise DraftConfigError(f"DFLASH {where}: invalid {name}={value!r}; it must be a finite number > 0. "
                               f"{FIX}")
    return number


def get(raw: dict, dcfg: dict, key: str) -> tuple[Any, str]:
    """`dflash_config.key` first, then top-level `key`; null counts as absent."""
    if dcfg.get(key) is not None:
        return dcfg[key], f"dflash_config.{key}"
    return raw.get(key), key
