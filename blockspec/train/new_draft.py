"""The draft a `train-draft` run trains: its z-lab config (resolved through the same validation every loaded
draft goes through) and its initial weights (from the target's top layers, random, or a previous draft
grown by layers)."""

from __future__ import annotations

from pathlib import Path

import torch

from blockspec.errors import BlockspecError, setting
from blockspec.models.config import ModelConfig
from blockspec.models.dflash2 import dflash2_from
from blockspec.models.dflash2_config import ARCHITECTURE2, Dflash2Config
from blockspec.models.draft import DFlashDraft
from blockspec.models.draft_config import DraftConfig, default_target_layer_ids, resolve_draft_config
from blockspec.models.loader import copy_layer, load_draft, model_tensors
from blockspec.models.target import CausalLM
from blockspec.train.config import TrainConfig
from blockspec.train.dflash2_setup import SELECTOR_INIT_STD, dflash2_keys

# Tried in order when no --mask-token(-id) is given: dedicated mask tokens, then rarely used specials.
MASK_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>", "<empty_output>")
FINAL_NORM_SCALE = 0.3  # the untrained draft's final norm: the target's, scaled (init_draft says why)


def pick_mask_token(tokenizer, vocab_size: int) -> tuple[str | None, int]:
    """An existing token for the MASK slots (the embedding is frozen, so no new row can be trained):
    a dedicated mask token if the tokenizer has one, else the first embedding row past the tokenizer's
    vocabulary (padding rows, as z-lab's Qwen3 drafts use), else a rarely used special token."""
    if tokenizer is not None:
        for token in MASK_CANDIDATES[:4]:
            if (i := tokenizer.token_to_id(token)) is not None and i < vocab_size:
                return token, i
        if tokenizer.vocab_size < vocab_size:
            return None, tokenizer.vocab_size
        for token in MASK_CANDIDATES[4:]:
            if (i := tokenizer.token_to_id(token)) is not None and i < vocab_size:
                return token, i
    raise BlockspecError(
        "train-draft: cannot pick a mask token: the target's tokenizer has no mask or spare token. Pass "
        "--mask-token-id with an existing, rarely used special token id (blockspec never adds new tokens).")


def make_draft_config(cfg: TrainConfig, target: ModelConfig, tokenizer,
                      init: Dflash2Config | None = None) -> DraftConfig:
    """Build the z-lab config.json content for the new draft (`init`: the --init draft's DFlash2 settings)
    and resolve it through the same validation every loaded draft goes through."""
    token, token_id = cfg.mask_token, cfg.mask_token_id
    if token_id is None and token is None:
        token, token_id = pick_mask_token(tokenizer, target.vocab_size)
    ids = cfg.target_layer_ids or default_target_layer_ids(target.num_hidden_layers, cfg.num_target_features)
    dflash: dict = {"target_layer_ids": list(ids), **dflash2_keys(cfg, init)}
    raw = {
        "architectures": [ARCHITECTURE2 if cfg.architecture == "dflash2" else "DFlashDraftModel"],
        "hidden_size": target.hidden_size,
        "num_hidden_layers": cfg.num_draft_layers, "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta, "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "num_target_layers": target.num_hidden_layers, "block_size": cfg.block_size, "dflash_config": dflash,
    }
    token_to_id = tokenizer.token_to_id if tokenizer is not None else None
    # the mask token as given on the command line: a name the vocabulary lacks is refused, not ignored
    return resolve_draft_config(raw, target=target, source="train-draft arguments", token_to_id=token_to_id,
                                cli_mask_token=token, cli_mask_token_id=token_id)


@torch.no_grad()
def init_draft(draft: DFlashDraft, target: CausalLM, how: str, generator: torch.Generator) -> None:
    """'random': small normal weights, unit norms. 'target': draft layer i starts as target layer
    L-n+i (the top layers) and `fc` picks the last tapped feature, so an untrained draft already reads
    the deepest tapped hidden state as its context. Both: the final norm is the target's, scaled down."""
    for name, (layer, own_name, tensor) in model_tensors(draft).items():
        random = torch.randn(tensor.shape, generator=generator) * 0.02
        layer.load(own_name, torch.ones(tensor.shape) if "norm" in name else random)
    # The final norm feeds the shared LM head (often tied to the embedding), which turns unit-RMS states
    # into very large logits: an untrained draft would be confidently wrong (SmolLM2: loss 17 with the
    # target's norm, 70 with ones, ~9.4 at 0.3x), and Adam moves a weight only ~lr per step. Start soft.
    copy_layer(draft.norm, target.norm, FINAL_NORM_SCALE)
    if draft.config.dflash2 is not None:  # identity convolutions: the draft starts as its DFlash backbone
        for layer in draft.layers:
            layer.attention_conv.set_identity()
            layer.mlp_conv.set_identity()
        draft.candidate_selector.init_random(generator, SELECTOR_INIT_STD)
    if how != "target":
        return
    n, big_l, h = len(draft.layers), len(target.layers), draft.config.hidden_size
    if target.layers[0].input_layernorm.folded:
        raise ValueError("init 'target' needs the checkpoint's layers: "
                         "load the target without fold_norm_weights()")
    for i, layer in enumerate(draft.layers):
        src = target.layers[big_l - n + i]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            copy_layer(layer.get_submodule(name), src.get_submodule(name))
        if src.self_attn.q_norm is not None:
            copy_layer(layer.self_attn.q_norm, src.self_attn.q_norm)
            copy_layer(layer.self_attn.k_norm, src.self_attn.k_norm)
    picks_last = torch.zeros(h, len(draft.config.target_layer_ids) * h)
    picks_last[:, -h:] = torch.eye(h)
    draft.fc.load("fc.weight", picks_last)
    copy_layer(draft.hidden_norm, draft.layers[0].input_layernorm)


def load_init_weights(folder: Path, mine: DraftConfig, target: ModelConfig, tokenizer,
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """--init FOLDER: the weights of an existing draft of the same shape. The block size may differ (the
    weights do not depend on it: a draft trained at 16 can be tuned for 4), and the draft may grow:
    extra layers are copies of its last layer with o_proj and down_proj zeroed, i.e. identity residual
    blocks, so the deeper draft starts out computing exactly what the old one did. A DFlash draft trained
    on as a DFlash2 one gets identity convolutions (the same hidden states) and a selector ~ N(0, 0.02)
    drawn from `seed`."""
    token_to_id = tokenizer.token_to_id if tokenizer else None
    old = load_draft(folder, target, torch.float32, torch.device("cpu"), token_to_id)
    theirs = old.config
    if mine.dflash2 is not None and theirs.dflash2 is None:
        old = dflash2_from(old, mine.dflash2, torch.Generator().manual_seed(seed), SELECTOR_INIT_STD)
        theirs = old.config
    for name in ("target_layer_ids", "mask_token_id", "num_hidden_layers", "has_embed_tokens", "dflash2"):
        if name == "num_hidden_layers" and mine.num_hidden_layers > theirs.num_hidden_layers:
            continue
        if getattr(mine, name) != getattr(theirs, name):
            raise BlockspecError(f"train-draft: {setting('init')} {folder} has {name}="
                                 f"{getattr(theirs, name)}, but this run trains {name}="
                                 f"{getattr(mine, name)}. Match the flags to that draft (see its "
                                 f"MODEL_CARD.md; it may be grown to more layers, not fewer), or start from "
                                 f"{setting('init')} target.")
    weights = old.state_dict()
    last = f"layers.{theirs.num_hidden_layers - 1}."
    for layer in range(theirs.num_hidden_layers, mine.num_hidden_layers):
        for key, value in list(weights.items()):
            if key.startswith(last):
                zero = key.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias"))
                weights[f"layers.{layer}." + key[len(last):]] = (torch.zeros_like(value) if zero
                                                                 else value.clone())
    return weights
