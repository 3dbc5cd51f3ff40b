"""`blockspec eval-draft`: a draft's greedy acceptance on a prompt set, without timing anything.

The target's plain greedy answers to the prompts (first turns, through the chat template, as `blockspec
bench` builds them) are generated once; then every answer position is an anchor, and the draft's block
there is scored exactly as greedy verification would score it: 1 + the leading slots whose proposal equals
the target's next token. Many more blocks than a bench run's steps, deterministic, and several drafts and
block sizes compared on the same answers. Evaluation only: the prompts are never trained on.
"""

from __future__ import annotations

import argparse

from blockspec.argparsing import RawHelpFormatter
from blockspec.config import MAX_BLOCK_SIZE
from blockspec.errors import BlockspecError


def register(sub) -> None:
    p = sub.add_parser("eval-draft", help="a draft's offline acceptance (tau per block size) on prompts",
                       description=__doc__, formatter_class=RawHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="HF target folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model-path", default=None, metavar="DIR[,DIR...]",
                   help="drafts to compare, each a folder or 'default' (the shipped draft of the embedded "
                        "target; default: that one)")
    p.add_argument("--dataset", default="humaneval,mt-bench",
                   help="prompt sets, a comma list of humaneval, mt-bench, PATH.jsonl")
    p.add_argument("--block-sizes", default="2,3,4",
                   help="block sizes to score, a comma list of integers >= 2")
    p.add_argument("--draft-quantization", default="none", metavar="{none,q8_0,q4_0,q4_1}[,...]",
                   help="forms to hold each draft's linear layers in, a comma list (none: fp32), each scored "
                        "on the same answers; blocks meet int8 activations as in the engine (default: none)")
    p.add_argument("--num-prompts", type=int, default=20, help="seeded subset of prompts per set, as bench's")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    p.add_argument("--seed", type=int, default=0, help="subset seed, as bench's --seed")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="where to run (auto: CUDA when visible, else the CPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads, at most the CPUs this process may use (more are capped, with a "
                        "warning; default: those CPUs)")
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT.json",
                   help="write the results here too (default: only the table, on stdout)")
    p.set_defaults(func=run_eval_draft)


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 2 or sizes[-1] > MAX_BLOCK_SIZE:
        raise BlockspecError(f"--block-sizes {text!r:.80} must be a comma-separated list of integers in "
                             f"[2, {MAX_BLOCK_SIZE}], e.g. 2,4,8.")
    return sizes


def _forms(text: str) -> list[str]:
    from blockspec.config import DRAFT_QUANTIZATIONS

    forms = [part.strip() for part in text.split(",") if part.strip()]
    bad = [f for f in forms if f not in DRAFT_QUANTIZATIONS or f == "auto"]
    if not forms or bad:
        raise BlockspecError(f"--draft-quantization {text!r:.80}: each form must be one of none, "
                             f"{', '.join(q for q in DRAFT_QUANTIZATIONS if q not in ('auto', 'none'))}.")
    return forms


def run_eval_draft(args: argparse.Namespace) -> None:
    """Check every flag, path and dataset before the target loads, then evaluate (eval_draft.py)."""
    from blockspec.config import EngineConfig
    from blockspec.paths import check_folder, check_output_file

    sizes, forms = _sizes(args.block_sizes), _forms(args.draft_quantization)
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise BlockspecError(f"--{name.replace('_', '-')}={getattr(args, name)} must be an integer >= 1.")
    if not 0 <= args.seed < 2**63:
        raise BlockspecError(f"--seed={args.seed} must be an integer in [0, 2**63).")
    if args.draft_model_path is None and args.model_path is not None:
        raise BlockspecError("eval-draft: --model-path is not the embedded target, so there is no default "
                             "draft; pass --draft-model-path DIR.")
    config = EngineConfig(model_path=args.model_path, speculative_algorithm="NONE", device=args.device,
                          threads=args.threads)
    if forms != ["none"] and config.device.type != "cpu":
        raise BlockspecError(f"--draft-quantization {args.draft_quantization}: block-held drafts run on the "
                             f"CPU only; pass --device cpu or --draft-quantization none.")
    from blockspec.paths import SHIPPED_DRAFT_NAME, draft_folder

    given = args.draft_model_path or SHIPPED_DRAFT_NAME
    paths = [draft_folder(p.strip()) for p in given.split(",") if p.strip()]
    for path in paths:
        check_folder(path, "draft_model_path", "DFlash draft folders (config.json + model.safetensors), or "
                     "'default' for the shipped one")
    if args.json_path:
        check_output_file(args.json_path, "json_path")
    from blockspec.bench.datasets import load_dataset
    from blockspec.train.eval_draft import run_eval_draft as run

    datasets = [load_dataset(name.strip()) for name in args.dataset.split(",") if name.strip()]
    if not datasets:
        raise BlockspecError("--dataset is empty: name humaneval, mt-bench or a PATH.jsonl.")
    run(args, sizes, paths, datasets, forms)
