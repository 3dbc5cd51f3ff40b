"""`blockspec eval-draft`'s work (its flags and checks: eval_cli.py): the target's answers generated once,
then every answer position scored as greedy verification would score the draft's block there."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm


def run_eval_draft(args: argparse.Namespace, sizes: list[int], paths: list[str], datasets: list,
                   forms: list[str]) -> None:
    """After eval_cli.py checked the flags: `sizes` the block sizes, `paths` the drafts, the prompt sets,
    `forms` how to hold each draft's linear layers ("none": dense fp32, or a block type)."""
    from blockspec.bench.datasets import select_subset
    from blockspec.bench.machine import command_line, machine_info, now_utc
    from blockspec.config import EngineConfig
    from blockspec.llm import LLM
    from blockspec.models.loader import load_draft
    from blockspec.sampling_params import SamplingParams
    from blockspec.train.data import TrainSequence
    from blockspec.train.features import target_features

    llm = LLM(EngineConfig(model_path=args.model_path, speculative_algorithm="NONE", device=args.device,
                           dtype="float32", threads=args.threads, max_num_seqs=max(1, args.num_prompts)))
    target, tokenizer = llm.target, llm.tokenizer
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
                got: dict[str, list] = {}
                for seq, (feats, labels) in zip(seqs, stored):
                    for key, value in block_accept_lengths(llm, draft, seq, feats, labels, size).items():
                        got.setdefault(key, []).append(value)
                got = {key: torch.cat(values) for key, values in got.items()}
                row[size] = {key: round(value.mean().item(), 4) for key, value in got.items()}
                row[size]["blocks"] = got["tau"].numel()
            results.setdefault(dataset.name, {})[path] = row
            figures = ", ".join(_describe(b, r) for b, r in row.items())
            print(f"{dataset.name:10} {path}: {figures}", flush=True)
    if args.json_path:
        report = {"results": results, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                  "subset_seed": args.seed, "machine": machine_info(llm.device, llm.dtype),
                  "command": command_line(), "date": now_utc()}
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def _describe(size: int, row: dict) -> str:
    """One block size's figures: tau (a DFlash2 draft's: its selector walk's, then the unary argmax's, the
    label's recall in the unary top-K and the teacher-forced selector accuracy)."""
    if "walk_tau" not in row:
        return f"B={size} tau {row['tau']:.3f} ({row['blocks']} blocks)"
    return (f"B={size} walk tau {row['walk_tau']:.3f} (unary tau {row['tau']:.3f}, recall@K "
            f"{row['recall_at_k']:.3f}, selector acc {row['selector_acc']:.3f}; {row['blocks']} blocks)")


@torch.inference_mode()
def block_accept_lengths(llm, draft, seq, feats, labels, block_size: int) -> dict[str, torch.Tensor]:
    """Greedy accept length of the draft's block at every anchor inside the answer ("tau": its argmax's).
    A DFlash2 draft adds its selector walk's ("walk_tau": what the engine proposes) and, per labelled slot,
    "recall_at_k" and "selector_acc" (selector_loss.dflash2_metrics)."""
    from blockspec.train.objective import TrainVocab, build_blocks, greedy_accept_lengths
    from blockspec.train.selector_loss import dflash2_metrics

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
    out = {"tau": greedy_accept_lengths(hidden, llm.target.lm_head, blocks, vocab).cpu()}
    if draft.config.dflash2 is not None:
        out.update(dflash2_metrics(draft, llm.target.lm_head, hidden, blocks))
    return out
