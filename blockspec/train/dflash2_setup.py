"""What `train-draft --architecture dflash2` adds to a draft's config: its convolution and selector settings,
new or those of the --init draft it continues."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from blockspec.errors import BlockspecError, setting
from blockspec.models.config import ModelConfig, read_config_json
from blockspec.models.dflash2_config import Dflash2Config
from blockspec.models.draft_config import resolve_draft_config

if TYPE_CHECKING:
    from blockspec.train.config import TrainConfig

# A new DFlash2 draft's selector rank and top-K (--selector-rank/--selector-top-k) and its convolution
DFLASH2_DEFAULTS = {"selector_rank": 64, "selector_top_k": 16, "conv_kernel_size": 2, "conv_group_size": 16}
SELECTOR_INIT_STD = 0.02  # codebooks and hidden projection ~ N(0, 0.02) (convolutions start at identity)


def init_dflash2(cfg: TrainConfig, target: ModelConfig, tokenizer) -> Dflash2Config | None:
    """The DFlash2 settings of the --init draft folder (None: 'target', 'random' or a DFlash draft)."""
    if cfg.init in ("target", "random"):
        return None
    folder = Path(cfg.init).expanduser()
    path, raw = read_config_json(folder, "Draft", f"Fix {setting('init')}.")
    token_to_id = tokenizer.token_to_id if tokenizer is not None else None
    return resolve_draft_config(raw, target=target, source=str(path), token_to_id=token_to_id).dflash2


def dflash2_keys(cfg: TrainConfig, init: Dflash2Config | None) -> dict:
    """The `dflash_config` entries of a DFlash2 draft to train: the --init draft's (continued), else the
    defaults; --selector-rank/--selector-top-k may set a new draft's, not change a trained one's."""
    if cfg.architecture == "dflash":
        if init is not None:
            raise BlockspecError(f"train-draft: {setting('init')} {cfg.init} is a DFlash2 draft; pass "
                                 f"{setting('architecture')} dflash2 to continue training it.")
        return {}
    keys = dict(DFLASH2_DEFAULTS) if init is None else init.json_keys()
    for name in ("selector_rank", "selector_top_k"):
        value = getattr(cfg, name)
        if value is not None and init is not None and value != keys[name]:
            raise BlockspecError(f"train-draft: {setting(name)}={value}, but {setting('init')} {cfg.init} "
                                 f"has {name}={keys[name]}; drop the flag (a trained selector keeps its "
                                 f"shape).")
        keys[name] = keys[name] if value is None else value
    return keys
