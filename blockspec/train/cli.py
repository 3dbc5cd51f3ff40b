"""`blockspec train-draft` (train a DFlash draft for a target, see trainer.py) and `blockspec eval-draft`
(a draft's offline acceptance, eval_draft.py)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from blockspec.errors import BlockspecError


def _layer_ids(values: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(v) for item in values for v in item.split(",") if v.strip())
    except ValueError as exc:
        raise BlockspecError(f"--target-layer-ids {' '.join(values)!r}: expected integers, "
                             f"e.g. 1 8 14 20 27.") from exc


def register(sub) -> None:
    p = sub.add_parser(
        "train-draft", help="train a DFlash draft for a target (resumable, z-lab checkpoint format)",
        description="Train a DFlash block-diffusion draft: frozen target, shared embedding/LM head, "
                    "random anchors, block-bidirectional masks, position-decayed cross-entropy.")
    a = p.add_argument
    a("--target", "--model-path", dest="target", default="default",
      help="HF target folder, or 'default' for the embedded SmolLM2-135M-Instruct")
    a("--output", required=True,
      help="draft folder to write (config.json, model.safetensors, MODEL_CARD.md, checkpoint/); required")
    a("--num-draft-layers", type=int, default=1, help="decoder layers in the draft")
    a("--block-size", type=int, default=16, help="DFlash block size the draft learns to fill")
    a("--target-layer-ids", nargs="+", default=None,
      help="target layers whose hidden states feed the draft (default: --num-target-features of them spread "
      "over 1..L-3)")
    a("--num-target-features", type=int, default=5,
      help="how many target layers to tap when --target-layer-ids is not given")
    a("--mask-token-id", type=int, default=None,
      help="the mask token the draft fills, by its id (default: the tokenizer's mask token or a spare "
      "special token)")
    a("--mask-token", default=None, help="the mask token by its text (default: as --mask-token-id)")
    a("--data", default="stdlib", help="training text, a comma list of: stdlib (Python's standard library "
      "source), pydoc (its documentation), responses:N (N of the target's own answers), PATH.jsonl")
    a("--tokens", type=int, default=None, help="cap on training-data tokens, shared evenly by the sources "
      "(responses and .jsonl first; what they leave goes to stdlib/pydoc; default: no cap)")
    a("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    a("--epochs", type=float, default=1.0, help="passes over the data, when --steps is not given")
    a("--lr", type=float, default=6e-4, help="peak learning rate (AdamW, cosine decay)")
    a("--warmup-ratio", type=float, default=0.04,
      help="share of the steps spent warming the learning rate up")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("--grad-clip", type=float, default=1.0, help="gradient norm clipping")
    a("--batch-size", type=int, default=4, help="sequences per step")
    a("--seq-len", type=int, default=512, help="tokens per training sequence")
    a("--anchors-per-seq", type=int, default=32, help="blocks drafted per sequence per step (random anchors)")
    a("--loss-gamma", type=float, default=None, help="position decay (default 7/5/4 for block 16/10/8)")
    a("--distill", type=float, default=0.0, metavar="ALPHA",
      help="soft labels: loss = (1-ALPHA)*CE + ALPHA*KL(target || draft), the target's distribution "
      "computed from the deepest tapped layer's cached features through its remaining layers "
      "(default 0: hard labels)")
    a("--init", default="target", help="target (draft layers start as the target's top layers), random, "
      "or a draft to continue from (same shape): a folder, or 'default' for the shipped one")
    a("--architecture", choices=["dflash", "dflash2"], default="dflash",
      help="dflash, or dflash2: + a causal convolution around each sublayer and a candidate selector over "
      "the unary top-K, trained with loss = DFlash loss + ALPHA * selector cross-entropy. With --init a "
      "DFlash draft it starts as that draft (identity convolutions, selector ~ N(0, 0.02)); with a DFlash2 "
      "draft it continues it (default: dflash)")
    a("--selector-rank", type=int, default=None,
      help="dflash2: rank r of the selector's codebooks [V, r] (default: the --init draft's, else 64)")
    a("--selector-top-k", type=int, default=None,
      help="dflash2: candidates K per drafted position (default: the --init draft's, else 16)")
    a("--selector-alpha", type=float, default=None, metavar="ALPHA",
      help="dflash2: weight of the selector's loss (default 1.0)")
    a("--selector-lr-scale", type=float, default=None, metavar="X",
      help="dflash2: the selector's learning rate is X times --lr (default 1.0; a selector new on a "
      "trained backbone starts near zero)")
    a("--train-vocab", type=int, default=None, metavar="N",
      help="training softmax over the N most frequent label tokens (a CPU speed-up; "
      "default: the full vocabulary)")
    a("--train-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
      help="autocast dtype for the draft's training forward (auto: bfloat16 on CUDA and on CPUs with "
      "bf16 matrix units, else float32)")
    a("--device", choices=["cpu", "cuda", "auto"], default="auto",
      help="where to train (auto: CUDA when visible, else the CPU)")
    a("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="auto",
      help="target dtype for feature extraction and response generation")
    a("--save-dtype", choices=["float32", "float16", "bfloat16"], default="float16",
      help="dtype of the written draft weights")
    a("--seed", type=int, default=0, help="seed of the data order, anchors and initial weights")
    a("--resume", action="store_true", help="continue the run saved in OUTPUT/checkpoint")
    a("--save-every", type=int, default=200, help="steps between checkpoints")
    a("--eval-every", type=int, default=100, help="steps between held-out tau measurements")
    a("--eval-seqs", type=int, default=16, help="held-out sequences per measurement")
    a("--eval-anchors", type=int, default=16, help="blocks drafted per held-out sequence")
    a("--response-tokens", type=int, default=256, help="max new tokens per on-policy response")
    a("--gen-batch-size", type=int, default=8, help="answers generated together for responses:N")
    a("--extract-batch-size", type=int, default=4, help="sequences per target pass when extracting features")
    a("--cache-dir", default=None, help="feature/response cache (default $BLOCKSPEC_HOME/train-cache)")
    a("--features", choices=["auto", "disk", "online"], default="auto",
      help="target features: extracted once and cached on disk (reused by later runs), or computed by the "
      "target for each batch (no disk; the fast path on a GPU). auto: online on CUDA, disk on CPU")
    a("--time-budget", type=float, default=None, metavar="SECONDS",
      help="fit the schedule to this much training time, measured over the first steps (--steps, if given, "
      "stays the cap); a resumed run keeps its schedule and stops with a checkpoint when the time is spent "
      "(default: no budget)")
    a("--stop-after-steps", type=int, default=None,
      help="stop with a checkpoint after N steps, to continue with --resume (default: run to the end)")
    a("--threads", type=int, default=None,
      help="CPU threads, at most the CPUs this process may use (more are capped, with a warning; "
      "default: those CPUs)")
    a("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=run_train)

    from blockspec.train.eval_cli import register as register_eval

    register_eval(sub)


def run_train(args: argparse.Namespace) -> None:
    from blockspec.device import set_threads
    from blockspec.train.config import TrainConfig
    from blockspec.train.trainer import train

    set_threads(args.threads)
    skip = {"command", "func", "json", "threads"}
    options = {k: v for k, v in vars(args).items() if k not in skip}
    if options["target_layer_ids"] is not None:
        options["target_layer_ids"] = _layer_ids(options["target_layer_ids"])
    cfg = TrainConfig(**options, command="blockspec " + shlex.join(sys.argv[1:]))
    summary = train(cfg)
    summary.pop("history", None)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {cfg.output} (step {summary['step']}/{summary['total_steps']}, held-out tau "
              f"{summary['heldout_tau']:.3f})", file=sys.stderr)
