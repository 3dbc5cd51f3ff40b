"""The public API: `LLM(...).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from blockspec.config import ALGORITHMS, EngineConfig
from blockspec.cpu_load import LoadAwareThreads
from blockspec.device import set_threads
from blockspec.distributed import TPGroup
from blockspec.engine.mirror import Mirror
from blockspec.engine.runner import ModelRunner
from blockspec.engine.scheduler import Scheduler, run_to_completion
from blockspec.engine.sequence import Sequence
from blockspec.engine.text_stream import TextStream, follow_text
from blockspec.errors import BlockspecError, DraftConfigError, RequestError, setting
from blockspec.model_choice import choose_models, target_folder
from blockspec.models.config import ModelConfig
from blockspec.models.default_model import gguf_path
from blockspec.models.loader import load_draft, load_target
from blockspec.models.parallel import check_tp
from blockspec.models.tokenizer import Tokenizer
from blockspec.outputs import RequestOutput, StreamDelta, request_output
from blockspec.ranks import build_together, follow, join_spawned, rank_threads, start_ranks, stop
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.decoder import Decoder
from blockspec.speculative.governor import SpecGovernor
from blockspec.speculative.plan import Speculation

log = logging.getLogger("blockspec")


class LLM:
    """`LLM(EngineConfig(...))`, or `LLM(**fields)` with EngineConfig's field names."""

    def __init__(self, config: EngineConfig | None = None, **settings) -> None:
        if config is not None and settings:
            raise BlockspecError(f"LLM: pass an EngineConfig or settings, not both (got "
                                 f"{sorted(settings)}).")
        cfg = config if config is not None else EngineConfig(**settings)
        group, processes = None, []
        if cfg.tp_size > 1:
            check_tp(ModelConfig.from_folder(target_folder(cfg)), cfg.tp_size)  # before any rank starts
            group, processes = start_ranks(cfg, rank_main)
        self.build(cfg, group, processes)
        if group is not None and group.rank != 0:  # a launcher's rank > 0: serve rank 0, then exit
            follow(self)
            raise SystemExit(0)

    def build(self, cfg: EngineConfig, group: TPGroup | None, processes: list) -> None:
        """This rank's engine: its shard of the target (all of it without `group`), the draft, the runner."""
        self.config, self.tp, self._processes = cfg, group, processes
        self.mirror = Mirror(group) if group is not None else None
        self._threads = torch.get_num_threads()
        build_together(group, lambda: self._build(cfg), self.close)
        if group is not None and group.rank == 0:
            atexit.register(self.close)

    def _build(self, cfg: EngineConfig) -> None:
        set_threads(rank_threads(cfg))
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        self.device, self.dtype = (cfg.device if self.tp is None else self.tp.device), cfg.dtype
        embedded = cfg.model_path is None
        self.weight_blocks = cfg.weight_blocks(embedded)  # None: dense weights
        self.activations = cfg.activations if self.weight_blocks is not None else "fp32"
        # What can be wrong is found before the target's weights load: its config, tokenizer and the draft.
        choice = choose_models(cfg)
        self.model_path, self.draft_model_path = choice.model_path, choice.draft_path
        self.max_model_len, target_cfg, draft_path = choice.max_model_len, choice.target_cfg, choice.draft_path
        self.tokenizer = Tokenizer.from_folder(self.model_path)
        self.draft = None
        self.draft_blocks = cfg.draft_blocks(self.weight_blocks) if draft_path is not None else None
        if draft_path is not None:
            self.draft = load_draft(
                draft_path, target_cfg, self.dtype, self.device, self.tokenizer.token_to_id,
                cli_block_size=cfg.block_size, cli_mask_token=cfg.mask_token,
                cli_mask_token_id=cfg.mask_token_id, quantization=self.draft_blocks,
            )
            if self.activations == "int8":
                self.draft.use_int8_activations()
        self.speculative_algorithm = "DFLASH" if self.draft is not None else "NONE"
        self.speculation = None
        if self.draft is not None:
            vocab = self.draft.vocab.numel() if self.draft.vocab is not None else target_cfg.vocab_size
            self.speculation = Speculation.from_config(cfg, self.draft.config, vocab)
        elif cfg.speculative_tree_budget:
            raise DraftConfigError(f"{setting('speculative_tree_budget')} needs a DFlash draft (trees are "
                                   f"built from its proposals); this LLM decodes without one.")
        gguf = gguf_path() if embedded and self.weight_blocks is not None else None
        self.target = load_target(self.model_path, self.dtype, self.device, self.weight_blocks, gguf,
                                  self.tp)
        self.target.fold_norm_weights()
        if self.activations == "int8":
            self.target.use_int8_activations()
        slab_len = self.max_model_len + (self.speculation.step_width if self.speculation else 1)
        for model in (self.target, self.draft):
            if model is not None:
                model.rotary.ensure(slab_len)
        self.runner = ModelRunner(self.target, self.draft, cfg.max_num_seqs, slab_len,
                                  prefix_caching=cfg.prefix_caching)
        # No thread count given: on the CPU compute with the CPUs other processes leave free (cpu_load.py)
        adapt = cfg.threads is None and self.device.type == "cpu" and self.tp is None
        threads = LoadAwareThreads.for_this_process() if adapt else None
        self.decoders = {"NONE": Decoder(self.runner, threads=threads)}
        if self.speculation is not None:
            governor = SpecGovernor() if cfg.adaptive_speculation else None
            self.decoders["DFLASH"] = Decoder(self.runner, self.speculation, governor, threads)
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(target_cfg.eos_token_ids)
        self._schedulers = 0

    def close(self) -> None:
        """Stop the tensor-parallel ranks (rank 0; also at exit). Nothing to do on one rank."""
        if self.__dict__.get("tp") is None or self.__dict__.get("_closed"):
            return
        self._closed = True
        if self.tp.rank == 0:
            stop(self.tp, self.mirror, self._processes)
        torch.set_num_threads(self._threads)  # as it was before this LLM

    @property
    def block_size(self) -> int:
        return self.speculation.block_size if self.speculation is not None else 1

    def set_block_size(self, block_size: int) -> None:
        """Run the loaded draft at another block size (a draft trained large runs smaller)."""
        self._set_speculation("block_size", block_size, 2, self.runner.max_len - self.max_model_len)

    def set_tree_budget(self, budget: int) -> None:
        """Verify candidate trees of `budget` nodes from now on (0: the chain only)."""
        self._set_speculation("tree_budget", budget, 0, self.runner.max_len - self.max_model_len - 1)

    def _set_speculation(self, name: str, value: int, low: int, high: int) -> None:
        """Change a speculative setting; the KV slabs were sized for the step width the LLM was built with
        (its block size, tree budget, lookup width and merged steps), which bounds it."""
        if self.speculation is None:
            raise DraftConfigError(f"set_{name} needs a DFlash draft; this LLM decodes without one.")
        width = self.runner.max_len - self.max_model_len
        if not isinstance(value, bool) and isinstance(value, int) and low <= value <= high:
            # a copy merged beside the draft's candidates makes a step wider than its block or tree
            excess = replace(self.speculation, **{name: value}).step_width - width
            high = value - excess if excess > 0 else high
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise DraftConfigError(f"DFLASH {name}={value!r} must be an integer in [{low}, {high}] for this "
                                   f"LLM (its KV slabs were sized for steps of up to {width} tokens); build "
                                   f"the LLM with the largest you will use.")
        setattr(self.speculation, name, value)
        if self.mirror is not None and self.tp.rank == 0:
            self.mirror.record(name, value)

    def clear_prefix_cache(self) -> None:
        """Forget every computed prefix the cache holds (a cold start)."""
        self.runner.prefix_cache.clear()
        if self.mirror is not None and self.tp.rank == 0:
            self.mirror.record("clear_prefix_cache")

    def scheduler(self, speculative_algorithm: str | None = None,
                  prefix_caching: bool | None = None) -> Scheduler:
        """A continuous-batching scheduler over this LLM's engine, decoding with DFlash or plainly;
        `prefix_caching` False: it neither reuses nor keeps computed prefixes (None: the LLM's setting).
        Every scheduler shares the LLM's prefix cache: prefixes carry over from call to call."""
        if self.__dict__.get("_closed"):
            raise BlockspecError("This tensor-parallel LLM was closed (its ranks stopped); build a new one.")
        algorithm = (speculative_algorithm or self.speculative_algorithm).upper()
        if algorithm not in ALGORITHMS:
            raise BlockspecError(f"speculative_algorithm={speculative_algorithm!r}; use one of "
                                 f"{ALGORITHMS}.")
        if algorithm not in self.decoders:
            raise DraftConfigError("DFLASH was requested but this LLM was built without a draft model.")
        mirror = None
        if self.mirror is not None and self.tp.rank == 0:  # the other ranks make its twin
            self._schedulers += 1
            mirror = (self.mirror, self._schedulers)
            self.mirror.record("scheduler", self._schedulers, algorithm, prefix_caching)
        return Scheduler(self.runner, self.decoders[algorithm], self.config.max_total_tokens,
                         self.config.prefill_tokens_per_step, self.config.prefill_decode_ratio, mirror,
                         prefix_caching)

    def sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """A request, its prompt checked against the vocabulary and the context length."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("The prompt is empty: send at least one token.")
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"Prompt token ids {bad[:5]!r} are outside the vocabulary [0, {vocab}).")
        if len(ids) + params.max_tokens > self.max_model_len:
            most, room = setting("max_tokens"), self.max_model_len - len(ids)
            raise RequestError(f"The prompt has {len(ids)} tokens and {most}={params.max_tokens}: together "
                               f"{len(ids) + params.max_tokens} exceed the context length "
                               f"{setting('max_model_len')}={self.max_model_len}. Shorten the prompt or "
                               f"lower {most}{f' (to at most {room})' if room > 0 else ''}.")
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
        scheduler = self.scheduler(speculative_algorithm)
        seqs = [self.sequence(p, sp) for p, sp in zip(prompts, param_list)]
        texts = {seq.seq_id: TextStream(self.tokenizer, seq.params.stop) for seq in seqs if seq.params.stop}

        def on_step(ran: list[Sequence]) -> None:
            for seq in ran:
                if seq.seq_id in texts:
                    follow_text(scheduler, seq, texts[seq.seq_id])

        run_to_completion(scheduler, seqs, on_step)
        failed = [(i, seq.error) for i, seq in enumerate(seqs) if seq.finish_reason == "error"]
        if failed:
            raise RequestError(f"{len(failed)} of {len(seqs)} requests failed (the others finished); the "
                               f"first, prompt {failed[0][0]}: {failed[0][1]}")
        return [self._output(seq, scheduler, texts.get(seq.seq_id)) for seq in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               speculative_algorithm: str | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding each engine step's new tokens and text as they are committed
        (with their sources, and the text token by token in `pieces`); the last delta holds the whole
        `RequestOutput`. `should_stop` is asked between steps: when it says
        so the request ends there (finish_reason "abort") with what it has. Closing the iterator early also
        stops the request between two steps and frees its KV slot (without a last delta)."""
        scheduler = self.scheduler(speculative_algorithm)
        seq = self.sequence(prompt, params or SamplingParams())
        text = TextStream(self.tokenizer, seq.params.stop)
        scheduler.add(seq)
        sent = 0
        try:
            while not seq.finished:
                if should_stop is not None and should_stop():
                    scheduler.abort(seq.seq_id)
                else:
                    scheduler.step()
                pieces = follow_text(scheduler, seq, text)
                if len(seq.output_ids) > sent or pieces:
                    yield StreamDelta("".join(p.text for p in pieces), seq.output_ids[sent:],
                                      seq.token_sources[sent:], pieces)
                    sent = len(seq.output_ids)
        finally:
            if not seq.finished:
                scheduler.abort(seq.seq_id)
        if seq.finish_reason == "error":
            raise RequestError(f"The request failed: {seq.error}")
        yield StreamDelta("", [], [], [], self._output(seq, scheduler, text))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        speculative_algorithm: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c) for c in conversations]
        return self.generate(prompts, params, speculative_algorithm)

    def chat_prompt(self, messages: list[dict]) -> str:
        """A conversation rendered by the target's chat template, ready for the assistant's turn."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _output(self, seq: Sequence, scheduler: Scheduler, text: TextStream | None) -> RequestOutput:
        speculative = scheduler.decoder.speculative
        return request_output(seq, speculative, self.block_size if speculative else 1,
                              text.text if text is not None else self.tokenizer.decode(seq.output_ids))


def rank_main(rank: int, address: str, cfg: EngineConfig) -> None:
    """A tensor-parallel rank `LLM` spawned: build this rank's shard of the engine, then replay rank 0 until
    it closes."""
    llm = LLM.__new__(LLM)
    llm.build(cfg, join_spawned(rank, address, cfg), [])
    follow(llm)
