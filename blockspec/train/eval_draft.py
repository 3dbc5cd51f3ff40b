"""`blockspec eval-draft`: a draft's greedy acceptance on a prompt set, without timing anything.

The target's plain greedy answers to the prompts (first turns, through the chat template, as `blockspec
bench` builds them) are generated once; then every answer position is an anchor, and the draft's block
there is scored exactly as greedy verification would score it: 1 + the leading slots whose proposal equals
the target's next token. Many more blocks than a bench run's steps, deterministic, and several drafts and
block sizes compared on the same answers. Evaluation only: the prompts are never trained on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.errors import BlockspecError


def register(sub) -> None:
    p = sub.add_parser("eval-draft", help="a draft's offline acceptance (tau per block size) on prompts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="HF target folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model-path", default=None, metavar="DIR[,DIR...]",
                   help="drafts to compare (default: the shipped draft of the embedded target)")
    p.add_argument("--dataset", default="humaneval,mt-bench",
                   help="comma list of humaneval, mt-bench, PATH.jsonl")
    p.add_argument("--block-sizes", default="2,3,4", help="comma list of block sizes >= 2")
    p.add_argument("--draft-quantization", default="none", metavar="{none,q8_0,q4_0,q4_1}[,...]",
                   help="comma list of forms to hold each draft's linear layers in (none: fp32), each scored "
                        "on the same answers; blocks meet int8 activations as in the engine")
    p.add_argument("--num-prompts", type=int, default=20, help="seeded subset, as bench's")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    p.add_argument("--seed", type=int, default=0, help="subset seed, as bench's --seed")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (default: torch's choice)")
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT.json",
                   help="write the results here")
    p.set_defaults(func=run_eval_draft)


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 2:
        raise BlockspecError(f"--block-sizes {text!r} must be a comma-separated list of integers >= 2, "
                             f"e.g. 2,4,8.")
    return sizes


def _forms(text: str) -> list[str]:
    from blockspec.config import DRAFT_QUANTIZATIONS

    forms = [part.strip() for part in text.split(",") if part.strip()]
    bad = [f for f in forms if f not in DRAFT_QUANTIZATIONS or f == "auto"]
    if not forms or bad:
        raise BlockspecError(f"--draft-quantization {text!r}: each form must be one of none, "
                             f"{', '.join(q for q in DRAFT_QUANTIZATIONS if q not in ('auto', 'none'))}.")
    return forms


def run_eval_draft(args: argparse.Namespace) -> None:
    from blockspec.bench.datasets import load_dataset, select_subset
    from blockspec.bench.report import command_line, machine_info, now_utc
    from blockspec.config import EngineConfig
    from blockspec.llm import DEFAULT_DRAFT, LLM
    from blockspec.models.loader import load_draft
    from blockspec.sampling_params import SamplingParams
    from blockspec.train.data import TrainSequence
    from blockspec.train.features import target_features

    sizes, forms = _sizes(args.block_sizes), _forms(args.draft_quantization)
    if args.draft_model_path is None and args.model_path is not None:
        raise BlockspecError("eval-draft: --model-path is not the embedded target, so there is no default "
                             "draft; pass --draft-model-path DIR.")
    paths = (args.draft_model_path or str(DEFAULT_DRAFT)).split(",")
    datasets = [load_dataset(name.strip()) for name in args.dataset.split(",") if name.strip()]
    llm = LLM(EngineConfig(model_path=args.model_path, speculative_algorithm="NONE", device=args.device,
                           dtype="float32", threads=args.threads, max_num_seqs=max(1, args.num_prompts)))
    target, tokenizer = llm.target, llm.tokenizer
    if forms != ["none"] and llm.device.type != "cpu":
        raise BlockspecError(f"--draft-quantization {args.draft_quantization}: block-held drafts run on the "
                             f"CPU only; pass --device cpu or --draft-quantization none.")
    drafts = {}
    for path in paths:
        for form in forms:
            draft = load_draft(path, target.config, torch.float32, llm.device, tokenizer.token_to_id,
                               quantization=None if form == "none" else form)
            if form != "none":
                draft.use_int8_activations()
            drafts[path if forms == ["none"] else f"{path} ({form})"] = draft
    results: dict = {}
    for dataset in datasets:
        prompts, note = select_subset(dataset, args.num_prompts, args.seed)
        if note:
            print(f"note: {note}", file=sys.stderr)
        chats = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
        prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True))
                      for c in chats]
        outs = llm.generate(prompt_ids, SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0))
        seqs = [TrainSequence(p + list(o.token_ids), len(p), True) for p, o in zip(prompt_ids, outs)]
        captures = {tuple(d.config.target_layer_ids) for d in drafts.values()}
        features = {c: [target_features(target, [s], c)[0] for s in seqs] for c in captures}
        for path, draft in drafts.items():
            row = {}
            for size in tqdm(sizes, desc=f"{dataset.name} {Path(path).name}", leave=False, file=sys.stderr):
                stored = features[tuple(draft.config.target_layer_ids)]
                got = torch.cat([block_accept_lengths(llm, draft, seq, feats, labels, size)
                                 for seq, (feats, labels) in zip(seqs, stored)])
                row[size] = {"tau": round(got.mean().item(), 4), "blocks": got.numel()}
            results.setdefault(dataset.name, {})[path] = row
            taus = ", ".join(f"B={b} tau {r['tau']:.3f} ({r['blocks']} blocks)" for b, r in row.items())
            print(f"{dataset.name:10} {path}: {taus}", flush=True)
    if args.json_path:
        report = {"results": results, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                  "subset_seed": args.seed, "machine": machine_info(llm.device, llm.dtype),
                  "command": command_line(), "date": now_utc()}
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


@torch.inference_mode()
def block_accept_lengths(llm, draft, seq, feats, labels, block_size: int) -> torch.Tensor:
    """Greedy accept length of the draft's block at every anchor inside the answer."""
    from blockspec.train.objective import TrainVocab, build_blocks, greedy_accept_lengths

    device, t = llm.device, len(seq.ids)
    draft.use_target_embedding(llm.target.embed_tokens)
    draft.rotary.ensure(t + block_size)
    ids = torch.tensor([seq.ids], device=device)
    labels = torch.from_numpy(labels.astype("int64")).unsqueeze(0).to(device)
    anchors = torch.arange(max(1, seq.start), t - 1, device=device).view(1, -1)
    blocks = build_blocks(ids, labels, [t], anchors, torch.ones_like(anchors, dtype=torch.bool), block_size,
                          draft.config.mask_token_id)
    hidden = draft(blocks.forward_batch(), torch.from_numpy(feats).float().unsqueeze(0).to(device))
    vocab = None
    if draft.vocab is not None:  # rank over the draft's own vocabulary, as the engine does
        marks = torch.zeros(llm.target.config.vocab_size)
        marks[draft.vocab.cpu()] = 1.0
        vocab = TrainVocab(llm.target.lm_head, marks, draft.vocab.numel())
    return greedy_accept_lengths(hidden, llm.target.lm_head, blocks, vocab).cpu()
