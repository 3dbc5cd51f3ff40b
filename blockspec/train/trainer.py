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
from dataclasses import fields
from pathlib import Path

import numpy as np
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
from blockspec.train.config import SAVE_DTYPES, TrainConfig, resolve_train_dtype
from blockspec.train.dflash2_setup import init_dflash2
from blockspec.train.model_card import write_model_card
from blockspec.train.new_draft import init_draft, load_init_weights, make_draft_config
from blockspec.train.objective import (TrainVocab, build_blocks, cosine_with_warmup, dflash_loss,
                                       greedy_accept_lengths, loss_weights, sample_anchors, steps_in_budget)
from blockspec.train.prepare import prepare_stores
from blockspec.train.selector_loss import dflash2_loss, dflash2_metrics
from blockspec.train.teacher import target_pass, teacher_hidden


# --time-budget: steps timed (at most; a linear warm-up over them) before the length is set
CALIBRATION_STEPS = 20
BUDGET_AIM, BUDGET_OVERRUN = 0.95, 1.1  # fit the run to 95% of the budget; stop with a checkpoint past 110%
UNBOUNDED_STEPS = 10**9


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
        self.state_path = cfg.output / "checkpoint" / "state.pt"
        if self.state_path.is_file() and not cfg.resume:
            raise BlockspecError(f"{cfg.output} already holds a training checkpoint ({self.state_path}). "
                                 f"Pass {setting('resume', 'resume=True')} to continue it, or choose another "
                                 f"{setting('output')}.")
        if cfg.resume and not self.state_path.is_file():
            raise BlockspecError(f"{setting('resume', 'resume=True')}: {cfg.output} holds no training "
                                 f"checkpoint (no {self.state_path}). Drop it to start a new run there, or "
                                 f"point {setting('output')} at the run to continue.")
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
        self._state = None  # --resume: the checkpoint, read (and checked) now
        if cfg.resume:
            self._state = torch.load(self.state_path, map_location="cpu", weights_only=False)  # RNG on CPU
            self.check_resumable(self._state)

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

    def batch(self, split: str, indices: list[int]) -> tuple:
        """(ids, labels, fp16 features or None when online) as CPU tensors padded to the longest row,
        lengths, starts. Reading the memory-mapped features is disk-bound once the stores outgrow the page
        cache, so `run` loads the next step's batch in a background thread while this step computes."""
        rows = [self.stores[split].get(i) for i in indices]
        lengths, starts = [len(r[0]) for r in rows], [r[3] for r in rows]
        t = max(lengths)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        labels = torch.zeros(len(rows), t, dtype=torch.long)
        feats = None if self.online else torch.zeros(len(rows), t, rows[0][2].shape[1], dtype=torch.float16)
        for i, (x, y, f, _) in enumerate(rows):  # copies out of the read-only memory maps
            ids[i, : len(x)] = torch.from_numpy(x.astype(np.int64))
            labels[i, : len(x)] = torch.from_numpy(y.astype(np.int64))
            if feats is not None:
                feats[i, : len(x)] = torch.from_numpy(np.array(f))
        return ids, labels, feats, lengths, starts

    def step_indices(self, step: int) -> list[int]:
        """Sequences of `step`: consecutive slices of per-epoch permutations seeded by (seed, epoch)."""
        n, out = self.num_train, []
        for i in range(step * self.cfg.batch_size, (step + 1) * self.cfg.batch_size):
            epoch = i // n
            if epoch not in self._perms:
                self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(
                    self.cfg.seed * 7919 + epoch))}
            out.append(int(self._perms[epoch][i % n]))
        return out

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
        """With features on disk training needs only the frozen embedding and LM head, plus, with --distill,
        the layers above the deepest tapped one (the teacher's distribution); online, the whole target."""
        self.target.requires_grad_(False)
        if self.online:
            return
        keep = ("embed_tokens", "lm_head") + (("layers", "norm", "rotary") if self.cfg.distill else ())
        for name in [n for n, _ in self.target.named_children() if n not in keep]:
            delattr(self.target, name)
        if self.cfg.distill:
            for i in range(max(self.draft_cfg.target_layer_ids) + 1):
                self.target.layers[i] = torch.nn.Identity()

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
                hidden, blocks, _, _ = self.forward(self.batch("eval", indices), self.cfg.eval_anchors, gen)
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
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = {"draft": self.draft.state_dict(), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "step": step, "history": self.history,
                 "total_steps": self.total_steps, "warmup": self.warmup,
                 "rng": torch.get_rng_state(), "fingerprint": self.cfg.fingerprint(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.state_path)
        self.export(step)

    def check_resumable(self, state: dict) -> None:
        """A checkpoint continues only with the settings it was trained with."""
        old, new = state["fingerprint"], self.cfg.fingerprint()
        default = {f.name: str(f.default) for f in fields(TrainConfig)}  # a field newer than the checkpoint
        diff = [f"{setting(k)}: {old.get(k, default[k])} -> {new[k]}" for k in new
                if old.get(k, default[k]) != new[k]]
        if diff:
            raise BlockspecError(f"{setting('resume', 'resume=True')}: the checkpoint in {self.state_path} "
                                 f"was trained with other settings ({'; '.join(diff)}). Rerun with the "
                                 f"original settings, or use a new {setting('output')}.")

    def load(self) -> int:
        state, self._state = self._state, None
        self.draft.load_state_dict(state["draft"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.history = state["history"]
        self.total_steps, self.warmup = (state.get("total_steps", self.total_steps),
                                         state.get("warmup", self.warmup))
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
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
        self.opt = torch.optim.AdamW(self.param_groups(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.warmup = max(1, round(cfg.warmup_ratio * self.total_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: cosine_with_warmup(s, self.total_steps, self.warmup))
        self.history: list[dict] = []
        self._perms: dict[int, torch.Tensor] = {}
        step = self.load() if cfg.resume and self.state_path.is_file() else 0
        # --time-budget: a new run's length is known once its first steps are timed (CALIBRATION_STEPS, or
        # fewer when they take a tenth of the budget); until then it warms up over those steps.
        fitting = cfg.time_budget is not None and step == 0
        calibrated = not fitting
        if fitting:
            self.total_steps, self.warmup = cfg.steps or UNBOUNDED_STEPS, CALIBRATION_STEPS
        weights = loss_weights(self.draft_cfg.block_size, cfg.loss_gamma).to(self.device)
        stop = (self.total_steps if cfg.stop_after_steps is None
                else min(self.total_steps, step + cfg.stop_after_steps))
        ema, seq_tokens, eval_seconds, evals, t0, first = None, 0, 0.0, 0, time.perf_counter(), step
        first_step_seconds = 0.0
        bar = tqdm(total=self.total_steps, initial=step, desc="train-draft", unit="step")
        loader = ThreadPoolExecutor(max_workers=1)
        upcoming = loader.submit(self.batch, "train", self.step_indices(step)) if step < stop else None
        try:
            while step < stop:
                batch = upcoming.result()
                if step + 1 < stop:
                    upcoming = loader.submit(self.batch, "train", self.step_indices(step + 1))
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
                    first_step_seconds = time.perf_counter() - t0
                ema = info["loss"] if ema is None else 0.95 * ema + 0.05 * info["loss"]
                record = {"step": step, **{k: round(info[k], 4) for k in ("loss", "acc1", "sel_loss",
                                                                          "recall") if k in info}}
                calibrate = not calibrated and step >= 3 and (
                    step >= CALIBRATION_STEPS or time.perf_counter() - t0 >= cfg.time_budget / 10)
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
                # The length is fitted at the calibration step and refined at each evaluation of the first
                # half.
                if fitting and (calibrate or (calibrated and evaluated and 2 * step < self.total_steps)):
                    fitted = steps_in_budget(step, elapsed, eval_seconds, evals, cfg.eval_every,
                                             BUDGET_AIM * cfg.time_budget, first_step_seconds)
                    self.total_steps = max(step, min(cfg.steps or UNBOUNDED_STEPS, fitted))
                    self.warmup = max(CALIBRATION_STEPS, round(cfg.warmup_ratio * self.total_steps))
                    stop = self.total_steps if cfg.stop_after_steps is None else min(self.total_steps, stop)
                    bar.total = self.total_steps
                    if calibrate:
                        tqdm.write(f"--time-budget {cfg.time_budget:g} s: {self.total_steps} steps "
                                   f"({elapsed / step:.3f} s/step so far)", file=sys.stderr)
                calibrated = calibrated or calibrate
                if (cfg.time_budget is not None and calibrated
                        and elapsed > BUDGET_OVERRUN * cfg.time_budget and step < stop):
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

    def param_groups(self) -> list[dict]:
        """The optimizer's groups: a DFlash2 draft's selector at --selector-lr-scale times the learning rate
        (it starts near zero on a trained backbone, and Adam moves a weight ~lr per step)."""
        named = [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad]
        selector = [p for n, p in named if n.startswith("candidate_selector.")]
        rest = [p for n, p in named if not n.startswith("candidate_selector.")]
        if not selector or self.cfg.selector_lr_scale == 1.0:
            return [{"params": rest + selector}]
        return [{"params": rest}, {"params": selector, "lr": self.cfg.lr * self.cfg.selector_lr_scale}]

    def train_vocab(self) -> TrainVocab:
        store, vocab_size = self.stores["train"], self.target_cfg.vocab_size
        counts = np.zeros(vocab_size, dtype=np.int64)
        # online, a label the target decides is counted as the text's next token
        for i in range(self.num_train):
            ids, labels, _, start = store.get(i)
            labels = np.where(labels >= 0, labels, np.append(ids[1:], ids[-1]))
            counts += np.bincount(labels[start:].astype(np.int64), minlength=vocab_size)
        vocab = TrainVocab(self.target.lm_head, torch.from_numpy(counts), self.cfg.train_vocab)
        self.stats["train_vocab"] = {"size": vocab.size, "label_coverage": vocab.coverage}
        return vocab

    def last(self, key: str) -> float:
        return next((r[key] for r in reversed(self.history) if key in r), float("nan"))


def train(cfg: TrainConfig) -> dict:
    return Trainer(cfg).run()
