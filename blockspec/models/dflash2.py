"""DFlash2 drafting: the candidates (the target head's top-K over the draft's output) and the selector's
lattice over them (its walk: layers/selector.py), and a DFlash2 draft made from a DFlash one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from blockspec.layers.embedding import LMHead
from blockspec.models.dflash2_config import Dflash2Config
from blockspec.models.draft import DFlashDraft


def unary_candidates(head: LMHead, hidden: torch.Tensor, d2: Dflash2Config,
                     vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each drafted position's K candidates, best first: (unary scores fp32 [b, γ, K], ids [b, γ, K]) for
    the draft's final-normed hidden states [b, γ, H], among the sorted token ids `vocab` only when the draft
    has a vocabulary. Unary = the target's logits times output_multiplier, softcapped; both are increasing,
    so the top-K of the raw logits is theirs (under tensor parallelism the logits are gathered first)."""
    b, steps, width = hidden.shape
    logits, columns = head.logits_over(hidden.reshape(-1, width), vocab)  # exact fp32 [b * γ, V or |vocab|]
    values, ids = logits.topk(d2.selector_top_k, dim=-1)
    ids = ids if columns is None else columns[ids]
    return unary_scores(values, d2).view(b, steps, -1), ids.view(b, steps, -1)


def unary_scores(logits: torch.Tensor, d2: Dflash2Config) -> torch.Tensor:
    """The target head's logits as a DFlash2 draft's unary scores: times output_multiplier, then the
    softcap tanh(x / cap) * cap (training applies the same to the logits its losses see)."""
    values = logits * d2.output_multiplier if d2.output_multiplier != 1.0 else logits
    if d2.final_logit_softcapping is not None:
        values = torch.tanh(values / d2.final_logit_softcapping) * d2.final_logit_softcapping
    return values


def lattice(draft: DFlashDraft, head: LMHead, hidden: torch.Tensor,
            anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(edge scores fp32 [b, γ, K, K], candidate ids [b, γ, K]) for a DFlash2 draft's hidden states at the
    drafted positions [b, γ, H] after the anchors [b] (each block's pending token)."""
    unary, candidates = unary_candidates(head, hidden, draft.config.dflash2, draft.vocab)
    return draft.candidate_selector.lattice(hidden, unary, candidates, anchor), candidates


@torch.no_grad()
def dflash2_from(draft: DFlashDraft, d2: Dflash2Config, generator: torch.Generator,
                 std: float = 0.02) -> DFlashDraft:
    """A DFlash2 draft that computes what the dense DFlash `draft` does: its weights, every convolution at
    identity (so the hidden states are the DFlash draft's), and a selector ~ N(0, std) drawn from
    `generator` (a warm start for training). Same dtype and device as `draft`."""
    if draft.config.dflash2 is not None:
        raise ValueError("dflash2_from: the draft is already a DFlash2 draft.")
    if any(getattr(module, "quant", None) is not None for module in draft.modules()):
        raise ValueError("dflash2_from: the draft holds weights as blocks; load it dense (no draft "
                         "quantization).")
    cfg = replace(draft.config, dflash2=d2, vocab_size=d2.vocab_size)
    rows = draft.embed_tokens.weight.shape[0] if draft.embed_tokens is not None else None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(draft.dtype)
    try:
        made = DFlashDraft(cfg, rows)
    finally:
        torch.set_default_dtype(previous)
    result = made.load_state_dict(draft.state_dict(), strict=False)
    new = [key for key in result.missing_keys if "_conv." not in key and "candidate_selector." not in key]
    if result.unexpected_keys or new:
        raise ValueError(f"dflash2_from: the draft's weights do not fit its DFlash2 form (missing {new}, "
                         f"unexpected {result.unexpected_keys}).")
    for layer in made.layers:
        layer.attention_conv.set_identity()
        layer.mlp_conv.set_identity()
    made.candidate_selector.init_random(generator, std)
    made.vocab = draft.vocab
    if draft.target_embedding is not None:
        made.use_target_embedding(draft.target_embedding)
    return made.to(draft.device).train(draft.training)
