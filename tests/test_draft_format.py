"""Every DFlash draft mistake in the table (tests/draft_mistakes.py) is refused, naming itself, before a
weight is read; docs/draft-format.md lists exactly the table's mistakes, DFlash and DFlash2 (those run in
test_dflash2.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from blockspec.errors import DraftConfigError
from blockspec.models import loader
from blockspec.models.config import ModelConfig
from blockspec.models.loader import load_draft
from tests.draft_mistakes import DFLASH, DFLASH2, edit, table
from tests.tiny import write_tiny_draft, write_tiny_target

DOC = Path(__file__).parent.parent / "docs" / "draft-format.md"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("format")
    cfg = ModelConfig.from_folder(write_tiny_target(folder / "target"))
    write_tiny_draft(folder / "draft", cfg, block_size=4)
    return cfg, folder / "draft"


def test_the_tiny_draft_loads(tiny):
    cfg, draft = tiny
    assert load_draft(draft, cfg, torch.float32, torch.device("cpu")).config.mask_token_id == 5


@pytest.mark.parametrize("mistake", DFLASH, ids=lambda m: m.what)
def test_every_mistake_is_named_before_a_weight_is_read(tiny, tmp_path, monkeypatch, mistake):
    cfg, draft = tiny
    shutil.copytree(draft, tmp_path / "d")
    edit(tmp_path / "d", mistake)
    monkeypatch.setattr(loader, "load_into", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(DraftConfigError, match=re.escape(mistake.says)):
        load_draft(tmp_path / "d", cfg, torch.float32, torch.device("cpu"))


def test_the_reference_lists_the_table():
    text = DOC.read_text()
    for name, mistakes in (("DFlash", DFLASH), ("DFlash2", DFLASH2)):
        assert table(mistakes) in text, (f"docs/draft-format.md's {name} mistakes differ from "
                                         f"tests/draft_mistakes.py; the table there:\n{table(mistakes)}")
    section = text.split("## Refused mistakes", 1)[1].splitlines()
    rows = [line for line in section if line.startswith("| ") and not line.startswith("| mistake |")]
    assert len(rows) == len(DFLASH) + len(DFLASH2), "docs/draft-format.md lists mistakes the table lacks"
