from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 as an HF folder in the real cache (converted once per machine, ~10 s)."""
    from blockspec.models.gguf_convert import ensure_default_model

    return ensure_default_model()
