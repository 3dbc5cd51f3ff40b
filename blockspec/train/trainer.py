"""The draft training loop (data from prepare.py), AdamW + cosine/warm-up + clipping, held-out tau,
resumable checkpoints, z-lab output with a model card.

Determinism: the batch order of step s and its anchors are functions of (seed, s) alone, so a run
resumed from a checkpoint (weights, optimizer, scheduler, step, RNG states) continues exactly as
an uninterrupted one would.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.device import resolve_device
from blockspec.errors import BlockspecError, setting
from blockspec.models.config import ModelConfig
from blockspec.models.default_model import ensure_default_model
from blockspec.models.draft import DFlashDraft
from blockspec.models.loader import save_draft
from blockspec.models.tokenizer import Tokenizer
from blockspec.paths import check_folder, check_output_folder
from blockspec.train import data as D
from blockspec.train.batches import Batches, label_counts
from blockspec.train.budget import TimeBudget
from blockspec.train.checkpoint import read_state, restore_rng, state_path, write_state
from blockspec.train.config import SAVE_DTYPES, TrainConfig, resolve_train_dtype
from blockspec.train.dflash2_setup import init_dflash2
from blockspec.train.model_card import write_model_card
from blockspec.train.new_draft import init_draft, load_init_weights, make_draft_config
from blockspec.train.objective import (TrainVocab, build_blocks, cosine_with_warmup, dflash_loss,
                                       greedy_accept_lengths, loss_weights, sample_anchors)
from blockspec.train.prepare import prepare_stores
from blockspec.train.selector_loss import dflash2_loss, dflash2_metrics, param_groups
from blockspec.train.teacher import freeze, target_pass, teacher_hidden




class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.train_dtype = resolve_train_dtype(cfg.train_dtype, self.device)
        self.online = cfg.features == "online" or (cfg.features == "auto" and self.device.type == "cuda")
        self.stats: dict = {"train_dtype": str(self.train_dtype).removeprefix("torch."),
                            "features": "online" if self.online else "disk"}
        # Everything a run could trip on is checked here, before data preparation (minutes on a CPU).
        self.spec = D.DataSpec.parse(cfg.data)
        check_output_folder(cfg.output, "output")
        if cfg.cache_dir is not None:
            check_output_folder(cfg.cache_dir, "cache_dir")
        self.state_path = state_path(cfg)
        if cfg.target != "default":
            check_folder(cfg.target, "target", "a Hugging Face target folder, or 'default' for the embedded "
                         "SmolLM2")
        self.target_path = (ensure_default_model() if cfg.target == "default"
                            else Path(cfg.target).expanduser())
        self.target_cfg = ModelConfig.from_folder(self.target_path)
        has_tok = (self.target_path / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_folder(self.target_path) if has_tok else None
        self.draft_cfg = make_draft_config(cfg, self.target_cfg, self.tokenizer,
                                           init_dflash2(cfg, self.target_cfg, self.tokenizer))
        if self.tokenizer is None and any(not s.endswith(".jsonl") for s in self.spec.sources):
            raise BlockspecError(f"train-draft: {self.target_path}/tokenizer.json is missing, "
                                 f"and {setting('data')}={cfg.data!r} needs it to tokenize text. "
                                 f"Add the tokenizer, or pass a .jsonl of token_ids.")
        # --init FOLDER: a draft of this shape, loaded now (a broken one fails before the data is prepared)
        self.init_weights = None if cfg.init in ("target", "random") else load_init_weights(
            Path(cfg.init).expanduser(), self.draft_cfg, self.target_cfg, self.tokenizer, cfg.seed)
        self._state = read_state(self.state_path, cfg) if cfg.resume else None  # read and checked now

    # ---- data -------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.target, self.stores = prepare_stores(self.cfg, self.spec, self.target_path, self.tokenizer,
                                                  self.draft_cfg.target_layer_ids, self.device, self.stats,
                                                  self.online)
        self.num_train, self.num_eval = len(self.stores["train"]), len(self.stores["eval"])
        if self.num_train == 0:
            raise BlockspecError(f"train-draft: {setting('data')}={self.cfg.data!r} yielded no training "
                                 f"sequences.")
        self.train_tokens = self.stores["train"].num_tokens
        self.batches = Batches(self.stores, self.cfg.batch_size, self.cfg.seed, self.online)

    # ---- model ------------------------------------------------------------------------------
    def forward(self, batch: tuple, count: int, generator: torch.Generator, teacher: bool = False):
        """For a `batch(...)`: (draft hidden states, blocks, tokens, the target's hidden states for the slots
        when `teacher`)."""
        ids, labels, feats, lengths, starts = batch
        ids, labels, final = ids.to(self.device), labels.to(self.device), None
        if feats is None:
            feats, labels, final = target_pass(self.target, ids, labels, self.draft_cfg.target_layer_ids)
        else:
            feats = feats.to(self.device).float()
        anchors, valid = sample_anchors(lengths, starts, count, generator)
        blocks = build_blocks(ids, labels, lengths, anchors.to(self.device), valid.to(self.device),
                              self.draft_cfg.block_size, self.draft_cfg.mask_token_id)
        hidden = self.draft(blocks.forward_batch(), feats)
        taught = (teacher_hidden(self.target, feats, blocks, self.draft_cfg.target_layer_ids, final)
                  if teacher else None)
        return hidden, blocks, sum(lengths), taught

    def attach_draft(self, draft: DFlashDraft) -> None:
        """The draft to train; it embeds its blocks with the target's frozen embedding (unless it has its
        own)."""
        self.draft = draft
        draft.use_target_embedding(self.target.embed_tokens)

    def freeze_target(self) -> None:
        freeze(self.target, self.online, self.cfg.distill > 0, self.draft_cfg.target_layer_ids)

    def amp(self):
        """bf16 autocast (fp32 master weights) when --train-dtype resolves to bfloat16."""
        return torch.autocast(self.device.type, torch.bfloat16, enabled=self.train_dtype == torch.bfloat16)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out tau estimate: mean over sampled anchors of 1 + leading slots where the draft's argmax
        equals the label (exactly greedy tau on on-policy labels; an estimate on teacher-forced text)."""
        gen, accepted, selector = torch.Generator().manual_seed(self.cfg.seed + 4242), [], {}
        for i in range(0, self.num_eval, self.cfg.batch_size):
            indices = list(range(i, min(self.num_eval, i + self.cfg.batch_size)))
            with self.amp():
                batch = self.batches.get("eval", indices)
                hidden, blocks, _, _ = self.forward(batch, self.cfg.eval_anchors, gen)
                accepted.append(greedy_accept_lengths(hidden, self.target.lm_head, blocks, self.vocab).cpu())
            if self.draft_cfg.dflash2 is not None:
                for key, value in dflash2_metrics(self.draft, self.target.lm_head, hidden, blocks).items():
                    selector.setdefault(key, []).append(value)
        lengths = torch.cat(accepted) if accepted else torch.zeros(0)
        out = {"tau": lengths.mean().item() if lengths.numel() else float("nan"), "blocks": lengths.numel()}
        # DFlash2: "tau" is the unary argmax's; "walk_tau" the selector walk's, the engine's proposal
        for key, values in selector.items():
            joined = torch.cat(values)
            out[key] = joined.mean().item() if joined.numel() else float("nan")
        return out

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, step: int) -> None:
        write_state(self.state_path, {
            "draft": self.draft.state_dict(), "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(), "step": step, "history": self.history,
            "total_steps": self.total_steps, "warmup": self.warmup, "fingerprint": self.cfg.fingerprint()})
        self.export(step)

    def load(self) -> int:
        state, self._state = self._state, None
        self.draft.load_state_dict(state["draft"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.history = state["history"]
        self.total_steps, self.warmup = (state.get("total_steps", self.total_steps),
                                         state.get("warmup", self.warmup))
        restore_rng(state)
        return state["step"]

    def export(self, step: int) -> None:
        self.draft.vocab = self.vocab.ids.cpu() if self.vocab is not None else None
        save_draft(self.draft, self.cfg.output, SAVE_DTYPES[self.cfg.save_dtype])
        write_model_card(self.cfg.output / "MODEL_CARD.md", self.cfg, self.draft_cfg, self.target_path,
                         self.spec,
                         {**self.stats, "step": step, "total_steps": self.total_steps, "train_sequences":
                          self.num_train, "train_tokens": self.train_tokens, "eval_sequences": self.num_eval,
                          "history": self.history, "machine": f"{platform.machine()} {self.device}, "
                          f"torch {torch.__version__}, {torch.get_num_threads()} threads"})

    # ---- loop -------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.prepare_data()
        self.total_steps = cfg.steps or max(1, math.ceil(cfg.epochs * self.num_train / cfg.batch_size))
        self.attach_draft(DFlashDraft(self.draft_cfg))
        if cfg.init in ("target", "random"):
            init_draft(self.draft, self.target, cfg.init, torch.Generator().manual_seed(cfg.seed))
        else:
            self.draft.load_state_dict(self.init_weights)
        self.freeze_target()
        self.vocab = self.train_vocab() if cfg.train_vocab else None
        self.draft.vocab = self.vocab.ids if self.vocab is not None else None  # DFlash2: candidates among it
        d2 = self.draft_cfg.dflash2
        if d2 is not None and self.vocab is not None and d2.selector_top_k > self.vocab.size:
            raise BlockspecError(f"train-draft: selector_top_k={d2.selector_top_k} is more than the "
                                 f"{self.vocab.size} tokens of {setting('train_vocab')}; raise it or pass a "
                                 f"smaller {setting('selector_top_k')}.")
        self.draft.rotary.ensure(cfg.seq_len + self.draft_cfg.block_size)
        self.draft.to(self.device).train()
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(param_groups(self.draft, cfg.lr, cfg.selector_lr_scale), lr=cfg.lr,
                                     betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.warmup = max(1, round(cfg.warmup_ratio * self.total_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: cosine_with_warmup(s, self.total_steps, self.warmup))
        self.history: list[dict] = []
        step = self.load() if cfg.resume and self.state_path.is_file() else 0
        budget = TimeBudget(cfg, step)
        self.total_steps, self.warmup = budget.start(self.total_steps, self.warmup)
        weights = loss_weights(self.draft_cfg.block_size, cfg.loss_gamma).to(self.device)
        stop = (self.total_steps if cfg.stop_after_steps is None
                else min(self.total_steps, step + cfg.stop_after_steps))
        ema, seq_tokens, eval_seconds, evals, t0, first = None, 0, 0.0, 0, time.perf_counter(), step
        bar = tqdm(total=self.total_steps, initial=step, desc="train-draft", unit="step")
        loader = ThreadPoolExecutor(max_workers=1)
        get, indices = self.batches.get, self.batches.indices
        upcoming = loader.submit(get, "train", indices(step)) if step < stop else None
        try:
            while step < stop:
                batch = upcoming.result()
                if step + 1 < stop:
                    upcoming = loader.submit(get, "train", indices(step + 1))
                gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
                with self.amp():
                    hidden, blocks, n_tok, teacher = self.forward(batch, cfg.anchors_per_seq, gen,
                                                                  teacher=cfg.distill > 0)
                    if d2 is None:
                        loss, info = dflash_loss(hidden, self.target.lm_head, blocks, weights, self.vocab,
                                                 teacher, cfg.distill)
                    else:
                        loss, info = dflash2_loss(hidden, self.target.lm_head, blocks, weights, self.draft,
                                                  cfg.selector_alpha, self.vocab, teacher, cfg.distill)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                step, seq_tokens = step + 1, seq_tokens + n_tok
                if step == first + 1:
                    budget.first_step_seconds = time.perf_counter() - t0
                ema = info["loss"] if ema is None else 0.95 * ema + 0.05 * info["loss"]
                record = {"step": step, **{k: round(info[k], 4) for k in ("loss", "acc1", "sel_loss",
                                                                          "recall") if k in info}}
                calibrate = budget.calibrates(step, time.perf_counter() - t0)
                evaluated = step % cfg.eval_every == 0 or step == stop or calibrate
                if evaluated:
                    t_eval = time.perf_counter()
                    record.update({f"heldout_{k}": v for k, v in self.evaluate().items()})
                    eval_seconds, evals = eval_seconds + time.perf_counter() - t_eval, evals + 1
                    walk = (f", walk tau {record['heldout_walk_tau']:.3f}" if "heldout_walk_tau" in record
                            else "")
                    tqdm.write(f"step {step}: loss {ema:.3f}, held-out tau {record['heldout_tau']:.3f}{walk}",
                               file=sys.stderr)
                self.history.append(record)
                elapsed = time.perf_counter() - t0
                fitted = budget.refit(step, elapsed, eval_seconds, evals, self.total_steps, calibrate,
                                      evaluated)
                if fitted is not None:
                    self.total_steps, self.warmup = fitted
                    stop = self.total_steps if cfg.stop_after_steps is None else min(self.total_steps, stop)
                    bar.total = self.total_steps
                    if calibrate:
                        tqdm.write(f"--time-budget {cfg.time_budget:g} s: {self.total_steps} steps "
                                   f"({elapsed / step:.3f} s/step so far)", file=sys.stderr)
                if budget.overrun(elapsed) and step < stop:
                    tqdm.write(f"--time-budget {cfg.time_budget:g} s overrun at step {step} of "
                               f"{self.total_steps}: saving a checkpoint; continue with --resume",
                               file=sys.stderr)
                    stop = step
                rate = seq_tokens / (time.perf_counter() - t0 - eval_seconds)
                bar.set_postfix(loss=f"{ema:.3f}", acc1=f"{info['acc1']:.2f}", tok_s=f"{rate:.0f}",
                                tau=f"{self.last('heldout_tau'):.2f}",
                                lr=f"{self.sched.get_last_lr()[0]:.1e}")
                bar.update(1)
                if step % cfg.save_every == 0 and step < stop:
                    self.save(step)
        except KeyboardInterrupt:
            tqdm.write(f"interrupted at step {step}: saving a checkpoint; continue with --resume",
                       file=sys.stderr)
        finally:
            bar.close()
            loader.shutdown(cancel_futures=True)
        seconds = time.perf_counter() - t0 - eval_seconds
        self.stats["train"] = {"steps": step - first, "seconds": seconds, "sequence_tokens": seq_tokens,
                               "tokens_per_s": seq_tokens / seconds if seconds else 0.0}
        self.save(step)
        return {"step": step, "total_steps": self.total_steps, "heldout_tau": self.last("heldout_tau"),
                "final_loss": self.last("loss"), **self.stats}

    def train_vocab(self) -> TrainVocab:
        counts = label_counts(self.stores["train"], self.target_cfg.vocab_size)
        vocab = TrainVocab(self.target.lm_head, counts, self.cfg.train_vocab)
        self.stats["train_vocab"] = {"size": vocab.size, "label_coverage": vocab.coverage}
        return vocab

    def last(self, key: str) -> float:
        return next((r[key] for r in reversed(self.history) if key in r), float("nan"))


def train(cfg: TrainConfig) -> dict:
    return Trainer(cfg).run()
