"""A DFlash draft's mask token: the token its blocks are filled with, by id or by text, from its config or
the command line, checked against the tokenizer and the vocabulary. Never a new token: the embedding has no
trained row for one."""

from __future__ import annotations

from typing import Callable

from blockspec.errors import DraftConfigError, setting
from blockspec.models.draft_values import Warn
from blockspec.models.draft_values import get as _get
from blockspec.models.draft_values import int_value as _int
from blockspec.models.draft_values import is_int as _is_int


def vocab_note(has_embed: bool, bound: int) -> str:
    if has_embed:
        return f"the draft's own embedding (embed_tokens.weight, vocab_size={bound})"
    return f"the target embedding (target vocab_size={bound})"


def resolve_mask(raw: dict, dcfg: dict, source: str, has_embed: bool, bound: int | None,
                 cli_token: str | None, cli_id: int | None,
                 token_to_id: Callable[[str], int | None] | None, warn: Warn) -> tuple[str | None, int]:
    """(mask_token, mask_token_id) from the draft's config, the command line's overrides and the tokenizer;
    `bound`: the ids the embedding holds (None: checked against the tensors later)."""
    cfg_token, token_where = _get(raw, dcfg, "mask_token")
    token, token_where = (cli_token, setting("mask_token")) if cli_token is not None else (
        cfg_token, token_where)
    if token is not None and (not isinstance(token, str) or not token):
        raise DraftConfigError(f"DFLASH mask_token must be a non-empty string, got {token_where}={token!r}. "
                               f"Give the token's text (e.g. '<|MASK|>'); "
                               f"to give an id use {setting('mask_token_id')}.")
    cfg_id, id_where = _get(raw, dcfg, "mask_token_id")
    if cfg_id is not None:
        _int(cfg_id, id_where, source, minimum=0)
    if cli_id is not None:
        _int(cli_id, setting("mask_token_id"), "given", minimum=0, fix="Pass an existing token id.")
        if bound is not None and cli_id >= bound:  # before any other judgement: no id this large exists
            own = f" (the draft's own: {cfg_id})" if cfg_id is not None else ""
            raise _out_of_range(f"{setting('mask_token_id')}={cli_id}", "given", has_embed, bound, own)
        if cfg_id is not None and cfg_id != cli_id:
            warn(f"DFLASH {setting('mask_token_id')}={cli_id} overrides the draft's {id_where}={cfg_id} "
                 f"({source}); "
                 f"the draft was trained with {cfg_id}.")
    explicit = cli_id if cli_id is not None else cfg_id
    where = setting("mask_token_id") if cli_id is not None else id_where
    vocab_id = token_to_id(token) if (token is not None and token_to_id is not None) else None
    vocab_id = vocab_id if _is_int(vocab_id) and vocab_id >= 0 else None  # type: ignore[operator]
    if token is not None and token_to_id is not None and vocab_id is None and explicit is not None:
        if cli_token is not None:  # asked for by name: never silently replaced by the config's id
            raise DraftConfigError(
                f"DFLASH {token_where}={token!r} is not in the target tokenizer's vocabulary, so it cannot "
                f"be the mask token. Drop it to use {where}={explicit} "
                f"({source if cli_id is None else 'given'}), or name a token the vocabulary has, or pass "
                f"{setting('mask_token_id')} with an id.")
        warn(f"DFLASH {source}: {token_where}={token!r} is not in the target tokenizer's vocabulary; using "
             f"{where}={explicit}.")
    if explicit is not None and bound is not None and explicit >= bound:
        raise _out_of_range(f"{where}={explicit}", source, has_embed, bound)
    if explicit is not None and vocab_id is not None and vocab_id != explicit:
        raise DraftConfigError(
            f"DFLASH config mismatch: {where}={explicit} conflicts with the tokenizer, which maps "
            f"mask_token={token!r} to id {vocab_id}. "
            f"Make them agree: drop one of them, or fix the draft config.")
    if explicit is None and vocab_id is None:
        table = "draft's" if has_embed else "target"
        why = ("no tokenizer is loaded to look it up" if token is not None and token_to_id is None
               else "it is not in the target tokenizer's vocabulary" if token is not None
               else "the draft config sets neither dflash_config.mask_token_id nor dflash_config.mask_token")
        raise DraftConfigError(
            f"DFLASH cannot resolve a mask token id for mask_token={token!r} ({source}): {why}. Adding the "
            f"token would need vocab expansion, which blockspec refuses: the {table} embedding has no "
            f"trained row for a new token. Pass {setting('mask_token_id')} with an existing reserved/unused "
            f"token id, "
            f"or use the id the draft was trained with (its dflash_config.mask_token_id).")
    mask_id = explicit if explicit is not None else vocab_id
    if bound is not None and mask_id >= bound:  # type: ignore[operator]
        label = f"{where if explicit is not None else 'mask_token_id'}={mask_id}"
        if token is not None:
            label += f" (mask_token={token!r}{', from the tokenizer' if explicit is None else ''})"
        raise _out_of_range(label, source, has_embed, bound)
    return token, mask_id  # type: ignore[return-value]


def _out_of_range(label: str, source: str, has_embed: bool, bound: int, own: str = "") -> DraftConfigError:
    return DraftConfigError(
        f"DFLASH {source}: {label} is outside {vocab_note(has_embed, bound)}, out of the vocabulary's "
        f"range: ids must be < {bound}. A new token would need vocab expansion, which blockspec refuses. Use "
        f"a draft and target from the same release, or pass {setting('mask_token_id')} with a "
        f"reserved/unused token id < {bound}{own}.")
