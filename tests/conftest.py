from pathlib import Path

import pytest
import torch

# One intra-op thread: the tiny test models are dispatch-bound, and on a shared or busy 2-core machine
# two OpenMP threads spin against each other (tests ran ~40x slower). Benchmarks choose their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 as an HF folder in the real cache (converted once per machine, ~10 s)."""
    from blockspec.models.default_model import ensure_default_model

    return ensure_default_model()
