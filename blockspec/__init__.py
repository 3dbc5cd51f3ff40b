"""blockspec: DFlash block-diffusion speculative decoding in plain PyTorch.

`import blockspec` is light: `LLM` and `RequestOutput` (torch, the engine) load on first use, so the command
line answers `--help` or a bad flag without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from blockspec.errors import BlockspecError
from blockspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from blockspec.llm import LLM
    from blockspec.outputs import RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "BlockspecError", "__version__"]
_LAZY = {"LLM": "blockspec.llm", "RequestOutput": "blockspec.outputs"}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from blockspec.version import version

        return version()
    if name not in _LAZY:
        raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
