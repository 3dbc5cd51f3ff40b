"""The public API: `LLM(...).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockspec.device import resolve_device, resolve_dtype
from blockspec.engine.engine import run_to_completion
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError, DraftConfigError, RequestError
from blockspec.models.default_model import ensure_default_model
from blockspec.models.loader import load_draft, load_target
from blockspec.models.tokenizer import Tokenizer
from blockspec.sampling_params import SamplingParams
from blockspec.spec.governor import SpecGovernor

log = logging.getLogger("blockspec")

DEFAULT_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-dflash"
ALGORITHMS = ("DFLASH", "NONE")


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    accept_lengths: list[int]
    finish_reason: str
    speculative_algorithm: str
    block_size: int
    time_to_first_token_s: float
    decode_time_s: float
    plain_steps: int = 0  # plain decode steps a DFlash request took instead of speculating (adaptive)
    lookup_accept_lengths: list[int] = field(default_factory=list)  # per prompt-lookup step (not in accept_lengths)
    extra: dict = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (prefill excluded)."""
        n = len(self.token_ids) - 1
        return n / self.decode_time_s if n > 0 and self.decode_time_s > 0 else 0.0


class LLM:
    def __init__(
        self,
        model_path: str | None = None,
        draft_model_path: str | None = None,
        speculative_algorithm: str | None = None,
        block_size: int | None = None,
        mask_token_id: int | None = None,
        mask_token: str | None = None,
        device: str | None = "auto",
        dtype: str | torch.dtype | None = "auto",
        seed: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        adaptive_speculation: bool = True,
        prompt_lookup_ngram: int = 2,
        prompt_lookup_block_size: int | None = None,
    ) -> None:
        algorithm = (speculative_algorithm or "").upper() or None
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise BlockspecError(
                f"speculative_algorithm={speculative_algorithm!r} is not supported; use one of {ALGORITHMS}."
            )
        if not isinstance(adaptive_speculation, bool):
            raise BlockspecError(f"adaptive_speculation={adaptive_speculation!r} must be True or False.")
        if isinstance(prompt_lookup_ngram, bool) or not isinstance(prompt_lookup_ngram, int) or prompt_lookup_ngram < 0:
            raise BlockspecError(f"prompt_lookup_ngram={prompt_lookup_ngram!r} must be an integer >= 1 (the shortest "
                                 f"context match whose continuation is proposed), or 0 to turn prompt lookup off.")
        if prompt_lookup_block_size is not None and (isinstance(prompt_lookup_block_size, bool) or not isinstance(
                prompt_lookup_block_size, int) or not 2 <= prompt_lookup_block_size <= 64):
            raise BlockspecError(f"prompt_lookup_block_size={prompt_lookup_block_size!r} must be an integer in [2, 64] "
                                 f"(the pending token + the proposed tokens verified in one pass), or None for "
                                 f"max(4, block size).")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise BlockspecError(f"max_num_seqs={max_num_seqs!r} must be an integer >= 1.")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if seed is not None:
            torch.manual_seed(seed)
        self.model_path = Path(model_path) if model_path else ensure_default_model()
        if draft_model_path is None and model_path is None and algorithm != "NONE" and DEFAULT_DRAFT.is_dir():
            draft_model_path = str(DEFAULT_DRAFT)
        if algorithm == "DFLASH" and draft_model_path is None:
            raise DraftConfigError(
                "DFLASH speculative decoding requires a draft: pass --draft-model-path (alias "
                "--speculative-draft-model-path), or use --speculative-algorithm NONE for plain decoding."
            )
        if algorithm == "NONE" and draft_model_path is not None:
            log.warning("speculative_algorithm=NONE: ignoring draft_model_path=%s", draft_model_path)
            draft_model_path = None
        self.target = load_target(self.model_path, self.dtype, self.device)
        self.target.fold_norm_weights()
        self.tokenizer = Tokenizer.from_folder(self.model_path)
        self.draft = None
        if draft_model_path is not None:
            self.draft = load_draft(
                draft_model_path, self.target.config, self.dtype, self.device, self.tokenizer.token_to_id,
                cli_block_size=block_size, cli_mask_token=mask_token, cli_mask_token_id=mask_token_id,
            )
        self.speculative_algorithm = "DFLASH" if self.draft is not None else "NONE"
        self.block_size = self.draft.config.block_size if self.draft is not None else 1
        cfg = self.target.config
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise BlockspecError(
                f"max_model_len={self.max_model_len} exceeds the target's max_position_embeddings="
                f"{cfg.max_position_embeddings}; lower it."
            )
        lookup_width = prompt_lookup_block_size or max(4, self.block_size)
        slab_len = self.max_model_len + max(self.block_size, lookup_width if prompt_lookup_ngram else 1)
        for model in (self.target, self.draft):
            if model is not None:
                model.rotary.ensure(slab_len)
        self.runner = ModelRunner(
            self.target, self.draft, self.block_size, self.draft.config.mask_token_id if self.draft else 0,
            num_slots=max_num_seqs, max_len=slab_len, governor=SpecGovernor() if adaptive_speculation else None,
            lookup_ngram=prompt_lookup_ngram, lookup_width=lookup_width,
        )
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)

    def set_block_size(self, block_size: int) -> None:
        """Run the loaded draft at another block size (a draft trained large runs smaller; the KV slabs
        were sized for the block size the LLM was built with, which bounds it)."""
        if self.draft is None:
            raise DraftConfigError("set_block_size needs a DFlash draft; this LLM decodes without one.")
        limit = self.runner.max_len - self.max_model_len
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= limit:
            raise DraftConfigError(
                f"DFLASH block_size={block_size!r} must be an integer in [2, {limit}] for this LLM (its KV slabs "
                f"were sized for block_size={limit}); build the LLM with the largest block size you will use."
            )
        self.block_size = block_size
        self.runner.set_block_size(block_size)

    def _sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("The prompt is empty: send at least one token.")
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"Prompt token ids {bad[:5]!r} are outside the vocabulary [0, {vocab}).")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"The prompt has {len(ids)} tokens and max_tokens={params.max_tokens}: together "
                f"{len(ids) + params.max_tokens} exceed the context length max_model_len={self.max_model_len}. "
                f"Shorten the prompt or lower max_tokens."
            )
        return Sequence(ids, params, self.stop_ids)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        speculative_algorithm: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt. `speculative_algorithm="NONE"` runs plain decoding on the same
        engine and weights even when a draft is loaded (the baseline)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise RequestError(f"Got {len(prompts)} prompts but {len(param_list)} SamplingParams.")
        algorithm = (speculative_algorithm or self.speculative_algorithm).upper()
        if algorithm not in ALGORITHMS:
            raise BlockspecError(f"speculative_algorithm={speculative_algorithm!r}; use one of {ALGORITHMS}.")
        if algorithm == "DFLASH" and self.draft is None:
            raise DraftConfigError("DFLASH was requested but this LLM was built without a draft model.")
        seqs = [self._sequence(p, sp) for p, sp in zip(prompts, param_list)]
        run_to_completion(self.runner, seqs, use_draft=algorithm == "DFLASH")
        return [self._output(seq, algorithm) for seq in seqs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        speculative_algorithm: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params, speculative_algorithm)

    def _output(self, seq: Sequence, algorithm: str) -> RequestOutput:
        return RequestOutput(
            prompt_token_ids=seq.prompt_ids,
            text=self.tokenizer.decode(seq.output_ids),
            token_ids=seq.output_ids,
            accept_lengths=seq.accept_lengths,
            finish_reason=seq.finish_reason,
            speculative_algorithm=algorithm,
            block_size=self.block_size if algorithm == "DFLASH" else 1,
            time_to_first_token_s=seq.first_token_time - seq.arrival_time,
            decode_time_s=seq.finish_time - seq.first_token_time,
            plain_steps=seq.plain_steps,
            lookup_accept_lengths=seq.lookup_accept_lengths,
        )
