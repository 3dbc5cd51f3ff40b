"""`EngineConfig`: every setting that shapes an engine, validated once, whichever way it comes in
(`LLM(...)`, the command line, the server, bench). The CLI's flags that set them: engine_flags.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from blockspec.errors import BlockspecError, setting
from blockspec.paths import check_folder, draft_folder

if TYPE_CHECKING:
    import torch

ALGORITHMS = ("DFLASH", "NONE")
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")
CPU_ACTIVATIONS = ("auto", "int8", "fp32")
DRAFT_QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")
# What "auto" takes for block weights: int8 activations, whose next-token distributions stay within rounding
# of the fp32 reference on held-out text (scripts/activation_quality.py measures it).
DEFAULT_CPU_ACTIVATIONS = "int8"
MAX_TREE_BUDGET = 64
MAX_BLOCK_SIZE = 64
MAX_SLOTS = 4096  # requests decoded together: each holds a KV slot
MAX_THREADS = 1024
TREE_RULES = ("best-first", "spine-first")
MERGE_RULES = ("auto", "always", "never")
ACCEPT_RULES = ("match", "rejection")  # sampled acceptance (speculative/rejection.py)
# Integer settings: (lowest, highest, what the value means); None is allowed for those in OPTIONAL.
RANGES = {
    "block_size": (2, MAX_BLOCK_SIZE, " (the pending token plus the drafted ones), or unset for the draft's "
                                      "own"),
    "mask_token_id": (0, 2**31 - 1, " (an existing token id)"),
    "seed": (-(2**63), 2**64 - 1, ""),
    "max_model_len": (1, 2**24, " (tokens of context)"),
    "max_num_seqs": (1, MAX_SLOTS, " (requests decoded together)"),
    "max_total_tokens": (1, 2**31 - 1, " (KV tokens)"),
    "prefill_tokens_per_step": (1, 2**20, ""),
    "prompt_lookup_ngram": (0, 64, " (the shortest context match whose continuation is proposed; 0: off)"),
    "prompt_lookup_block_size": (2, 64, " (the pending token + the proposed tokens verified in one pass), "
                                        "or unset for max(4, block size)"),
    "speculative_tree_budget": (0, MAX_TREE_BUDGET, ": the candidate nodes a DFlash step verifies beyond "
                                                    "its pending token (0: the draft's chain only)"),
    "speculative_tree_topk": (1, MAX_TREE_BUDGET, ": the draft's best tokens per block position a tree may "
                                                  "hold (a DFlash2 draft: prefixes kept per depth)"),
    "threads": (1, MAX_THREADS, " (CPU threads)"),
    "tp_size": (1, 1024, " (tensor-parallel ranks)"),
}
OPTIONAL = {"block_size", "mask_token_id", "seed", "max_model_len", "max_total_tokens",
            "prefill_tokens_per_step", "prompt_lookup_block_size", "threads"}


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # a Hugging Face target folder; None: the embedded SmolLM2-135M-Instruct
    draft_model_path: str | None = None  # a z-lab DFlash draft; None: the embedded target's shipped draft
    speculative_algorithm: str | None = None  # "DFLASH", "NONE" (plain decoding); None: DFLASH given a draft
    block_size: int | None = None  # DFlash block size; None: the draft's own
    mask_token_id: int | None = None  # overrides the draft's mask token
    mask_token: str | None = None
    device: str | torch.device | None = "auto"  # resolved to a torch.device
    dtype: str | torch.dtype | None = "auto"  # resolved to a torch.dtype (auto: fp32 on CPU, bf16 on CUDA)
    # The target's weights on the CPU: GGUF blocks (a type, or auto: the embedded model's own blocks; their
    # activations: `cpu_activations`), or none: dense in `dtype` (see `weight_blocks`).
    quantization: str = "auto"
    # How block weights meet activations: int8 blocks of 32 (integer dot products), fp32 (the exact
    # reference), or auto (DEFAULT_CPU_ACTIVATIONS). Dense weights are unaffected.
    cpu_activations: str = "auto"
    # The draft's linear layers on the CPU: blocks of a type (quantized from its checkpoint at load, taking
    # the target's activation form), none (dense), or auto (q8_0 when the target holds blocks).
    draft_quantization: str = "auto"
    seed: int | None = None  # torch's global seed (requests carry their own)
    max_model_len: int | None = None  # context length; None: min(max_position_embeddings, 4096)
    max_num_seqs: int = 8  # requests decoded together, one KV slot each
    max_total_tokens: int | None = None  # KV budget in tokens; None: every slot can hold a full context
    prefill_tokens_per_step: int | None = None  # prompt tokens prefilled per engine step (None: 512)
    # while requests decode, prefill tokens per step per row they verify (None: 2; 0: no sharing)
    prefill_decode_ratio: float | None = None
    adaptive_speculation: bool = True  # a plain step where speculating is not expected to pay
    prompt_lookup_ngram: int = 2  # propose a context copy after a match of >= N tokens (0: off)
    prompt_lookup_block_size: int | None = None  # tokens verified per lookup step; None: max(4, block size)
    # a copy verified with the draft's candidates as one tree: auto (adaptive speculation decides), always,
    # or never
    prompt_lookup_merge: str = "auto"
    speculative_tree_budget: int = 0  # candidate trees of this many nodes (0: the draft's chain only)
    speculative_tree_topk: int = 4  # a tree's tokens per block position, at most
    speculative_tree_rule: str = "best-first"  # or "spine-first": the draft's chain, then the best others
    # sampled requests: "match" (a draft token kept with probability p; seeds give plain decoding's tokens)
    # or "rejection" (the draft samples, kept with min(1, p/q); the target's distribution, other tokens)
    speculative_accept: str = "match"
    threads: int | None = None  # torch intra-op CPU threads (None: torch's choice; under TP on the CPU:
    # the cores shared out among this machine's ranks)
    tp_size: int = 1  # tensor-parallel ranks (blockspec/distributed.py)
    tp_backend: str = "auto"  # torch.distributed backend: auto (gloo on the CPU, NCCL on CUDA), gloo, nccl
    prefix_caching: bool = True  # reuse computed prefixes, target and draft (engine/prefix_cache.py)

    def __post_init__(self) -> None:
        """Every value checked here, before anything loads; messages name the flags under the CLI
        (`errors.setting`)."""
        import torch

        from blockspec.device import resolve_device, resolve_dtype  # torch: imported when a config is made

        algorithm = self.speculative_algorithm
        if algorithm is not None and (not isinstance(algorithm, str) or algorithm.upper() not in ALGORITHMS):
            raise BlockspecError(f"{setting('speculative_algorithm')}={algorithm!r:.80} is not supported; "
                                 f"use one of {', '.join(ALGORITHMS)}.")
        object.__setattr__(self, "speculative_algorithm", algorithm.upper() if algorithm else None)
        if self.model_path is not None:
            check_folder(self.model_path, "model_path", "a Hugging Face checkpoint folder (config.json, "
                         "*.safetensors, tokenizer.json), or none for the embedded SmolLM2", needs=None)
        if self.draft_model_path is not None:
            object.__setattr__(self, "draft_model_path", draft_folder(self.draft_model_path))
            check_folder(self.draft_model_path, "draft_model_path", "a DFlash draft folder (config.json and "
                         "model.safetensors, z-lab format), or 'default' for the shipped one", needs=None)
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, device))
        if self.quantization not in QUANTIZATIONS:
            raise BlockspecError(f"{setting('quantization')}={self.quantization!r:.80} is not supported; "
                                 f"use one of {', '.join(QUANTIZATIONS)}.")
        if (self.quantization not in ("auto", "none")
                and (device.type != "cpu" or self.dtype != torch.float32)):
            raise BlockspecError(f"{setting('quantization')}={self.quantization}: block-quantized weights "
                                 f"run on the CPU with float32 activations, not on {device} in {self.dtype}. "
                                 f"Use {setting('device')}=cpu {setting('dtype')}=float32, or "
                                 f"{setting('quantization')}=none.")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise BlockspecError(f"{setting('cpu_activations')}={self.cpu_activations!r:.80} is not "
                                 f"supported; use one of {', '.join(CPU_ACTIVATIONS)}.")
        if not isinstance(self.prefix_caching, bool):
            raise BlockspecError(f"prefix_caching={self.prefix_caching!r:.80} must be True or False.")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise BlockspecError(f"{setting('draft_quantization')}={self.draft_quantization!r:.80} is not "
                                 f"supported; use one of {', '.join(DRAFT_QUANTIZATIONS)}.")
        if self.draft_quantization not in ("auto", "none") and (device.type != "cpu"
                                                                or self.dtype != torch.float32):
            raise BlockspecError(f"{setting('draft_quantization')}={self.draft_quantization}: "
                                 f"block-quantized weights run on the CPU in float32, not on {device} in "
                                 f"{self.dtype}. Use "
                                 f"{setting('device')}=cpu {setting('dtype')}=float32, or "
                                 f"{setting('draft_quantization')}=none.")
        if not isinstance(self.adaptive_speculation, bool):
            raise BlockspecError(f"adaptive_speculation={self.adaptive_speculation!r:.80} must be True or "
                                 f"False.")
        self._check_ranges()

        from blockspec.distributed import check_devices, resolve_backend

        resolve_backend(self.tp_backend, device)
        check_devices(self.tp_size, device)

    def _check_ranges(self) -> None:
        for name, (low, high, meaning) in RANGES.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise BlockspecError(f"{setting(name)}={value!r:.80} must be an integer in [{low}, {high}]"
                                     f"{meaning}.")
        ratio = self.prefill_decode_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                                  or not 0 <= ratio <= 1e6):
            raise BlockspecError(f"{setting('prefill_decode_ratio')}={ratio!r:.80} must be a number in "
                                 f"[0, 1e6].")
        if self.speculative_tree_rule not in TREE_RULES:
            raise BlockspecError(f"{setting('speculative_tree_rule')}={self.speculative_tree_rule!r:.80} "
                                 f"must be one of {', '.join(TREE_RULES)}.")
        if self.speculative_accept not in ACCEPT_RULES:
            raise BlockspecError(f"{setting('speculative_accept')}={self.speculative_accept!r:.80} "
                                 f"must be one of {', '.join(ACCEPT_RULES)}.")
        if self.prompt_lookup_merge not in MERGE_RULES:
            raise BlockspecError(f"{setting('prompt_lookup_merge')}={self.prompt_lookup_merge!r:.80} "
                                 f"must be one of {', '.join(MERGE_RULES)}.")

    def weight_blocks(self, embedded: bool) -> str | None:
        """How the target holds its weights: None (dense, in `dtype`), a block type for every linear layer,
        or "stored": the GGUF's own blocks (auto, for the embedded model, on the CPU in float32)."""
        import torch

        if self.quantization == "auto":
            cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
            return "stored" if embedded and cpu_fp32 else None
        return None if self.quantization == "none" else self.quantization

    def draft_blocks(self, target_blocks: str | None) -> str | None:
        """How the draft holds its linear layers: None (dense) or a block type (auto: q8_0 beside a target
        held as blocks)."""
        if self.draft_quantization == "auto":
            return "q8_0" if target_blocks is not None else None
        return None if self.draft_quantization == "none" else self.draft_quantization

    @property
    def activations(self) -> str:
        """How block weights meet activations: "int8" or "fp32" (auto resolved)."""
        return DEFAULT_CPU_ACTIVATIONS if self.cpu_activations == "auto" else self.cpu_activations

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """From parsed command-line flags (their dests are the field names)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})
