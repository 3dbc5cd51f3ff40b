"""Tiny random checkpoints written by transformers, shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def examples(n: int) -> int:
    """A property test's example count: n on CI, times $BLOCKSPEC_EXAMPLES_SCALE for a longer search."""
    return max(1, round(n * float(os.environ.get("BLOCKSPEC_EXAMPLES_SCALE", "1"))))


def tiny_hf_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    return Qwen3Config(head_dim=16, **common)


def write_tiny_target(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give peaked, tie-free distributions
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def tiny_draft_raw(target_cfg, num_layers: int = 2, block_size: int = 4, mask_token_id: int = 5,
                   **overrides) -> dict:
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target_cfg.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "num_target_layers": target_cfg.num_hidden_layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [0, 2]},
    }
    raw.update(overrides)
    return raw


def write_tiny_draft(folder: Path, target_cfg, seed: int = 0, scale: float = 0.2, **kwargs) -> Path:
    """A random DFlash draft in z-lab format for the given target config."""
    from blockspec.models.draft import DFlashDraft
    from blockspec.models.draft_config import resolve_draft_config
    from blockspec.models.loader import save_draft

    cfg = resolve_draft_config(tiny_draft_raw(target_cfg, **kwargs), target=target_cfg)
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * scale)
    save_draft(draft, folder)
    return folder


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<mask>"]  # ids 0..5
TINY_CHARS = (" \n" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789"
              + ".,!?;:'\"()[]{}-+=*/%&#@$<>_")


def write_tiny_tokenizer(folder: Path) -> Path:
    """A 97-token character-level tokenizer (ids 0..5 special, 6..96 one character each;
    eos = <|im_end|> = 2, the tiny target's eos; mask = 5, the tiny draft's) with a ChatML template.
    Decoding concatenates."""
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + list(TINY_CHARS))}
    assert len(vocab) == 97
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS])
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
              "chat_template": TINY_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tiny_target_with_draft(folder: Path, kind: str, device, draft_block_size: int):
    """A tiny target of `kind` ("llama", "qwen3", or "llama-q4_1": its linear layers held as Q4_1 blocks),
    loaded in fp32, and a random draft for it written beside it: (target, its config, the draft's folder)."""
    from blockspec.models.config import ModelConfig
    from blockspec.models.loader import load_target

    family, _, quantization = kind.partition("-")
    write_tiny_target(folder / "target", family)
    cfg = ModelConfig.from_folder(folder / "target")
    write_tiny_draft(folder / "draft", cfg, block_size=draft_block_size)
    return load_target(folder / "target", torch.float32, device, quantization or None), cfg, folder / "draft"


class ScriptedGovernor:
    """Stands in for SpecGovernor in tests: speculates (True) or decodes plainly (False) by a fixed
    cyclic script instead of by timing, so runs are deterministic and mix every kind of step."""

    def __init__(self, script: list[bool]) -> None:
        self.script, self.step = script or [True], 0

    def speculate(self, seqs, shape) -> bool:
        self.step += 1
        return self.script[(self.step - 1) % len(self.script)]

    def lookup_pays(self, seqs, width) -> bool:
        return True  # every row copies: verify the copies, as without a governor

    def mix(self, seqs, copied, shape, width) -> bool:
        """The same script decides whether a batch where only some rows have a lookup match takes a mixed
        step."""
        return self.speculate(seqs, shape)

    def merge(self, seqs, copied, shape, width) -> bool:
        """Rows with a copy: the same script decides whether the copies merge with the draft's candidates
        (else the copies alone are verified)."""
        return self.speculate(seqs, shape)

    def shape(self, seqs, shapes):
        """Drafted steps take the chain and the tree in turn."""
        return shapes[self.step % len(shapes)]

    def record(self, plan, seqs, seconds, alone=None) -> None:
        pass


class TinyEngine:
    """A runner over a target and a draft with a DFlash decoder and a plain one, as `LLM` wires them."""

    def __init__(self, target, draft, block_size: int, num_slots: int, max_len: int,
                 lookup: tuple[int, int] = (0, 0), governor=None, tree: tuple[int, int, str] = (0, 4,
                                                                                   "best-first"),
                 prefix_caching: bool = False, merge: str = "auto", accept: str = "match") -> None:
        from blockspec.engine.runner import ModelRunner
        from blockspec.speculative.decoder import Decoder
        from blockspec.speculative.plan import Speculation

        self.speculation = Speculation(block_size, draft.config.mask_token_id, *lookup, *tree, merge, accept)
        self.runner = ModelRunner(target, draft, num_slots, max_len, prefix_caching=prefix_caching)
        self.dflash = Decoder(self.runner, self.speculation, governor)
        self.plain = Decoder(self.runner)

    def set_block_size(self, block_size: int) -> None:
        self.speculation.block_size = block_size

    def scheduler(self, use_draft: bool, **kwargs):
        from blockspec.engine.scheduler import Scheduler

        return Scheduler(self.runner, self.dflash if use_draft else self.plain, **kwargs)

    def run(self, seqs, use_draft: bool, **kwargs):
        from blockspec.engine.scheduler import run_to_completion

        on_step = kwargs.pop("on_step", None)
        run_to_completion(self.scheduler(use_draft, **kwargs), seqs, on_step)
        return seqs
