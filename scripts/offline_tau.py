"""A draft's greedy tau on a benchmark's prompts without timing anything: the target's plain greedy answers
(first turns, chat template, as `blockspec bench` builds them) are generated once, then every response
position is an anchor and each draft's block is scored against the answer, exactly as greedy verification
would (1 + the leading slots whose proposal equals the target's next token). Many more blocks than a
bench run's steps, deterministic, and several drafts compared on the same answers; evaluation only, the
prompts are never trained on.

    PYTHONPATH=. python scripts/offline_tau.py [--datasets humaneval,mt-bench] [--block-sizes 2,3,4]
        [--drafts blockspec/drafts/smollm2-135m-dflash,OTHER] [--num-prompts 20] [--max-new-tokens 128]
"""

import argparse

import torch
from tqdm import tqdm

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import load_dataset, select_subset
from blockspec.llm import DEFAULT_DRAFT
from blockspec.models.loader import load_draft
from blockspec.train.data import TrainSequence
from blockspec.train.features import target_features
from blockspec.train.objective import TrainVocab, build_blocks, greedy_accept_lengths

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--datasets", default="humaneval,mt-bench")
parser.add_argument("--block-sizes", default="2,3,4")
parser.add_argument("--drafts", default=str(DEFAULT_DRAFT))
parser.add_argument("--num-prompts", type=int, default=20)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--seed", type=int, default=0, help="subset seed, as bench --seed")
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
llm = LLM(speculative_algorithm="NONE", max_num_seqs=args.num_prompts)
target, tokenizer = llm.target, llm.tokenizer
drafts = {path: load_draft(path, target.config, torch.float32, llm.device, tokenizer.token_to_id)
          for path in args.drafts.split(",")}
sizes = [int(b) for b in args.block_sizes.split(",")]


@torch.inference_mode()
def accept_lengths(draft, seq: TrainSequence, feats, labels, block_size: int) -> torch.Tensor:
    """Greedy accept length of the draft's block at every anchor inside the response."""
    t = len(seq.ids)
    ids, labels = torch.tensor([seq.ids]), torch.from_numpy(labels.astype("int64")).unsqueeze(0)
    anchors = torch.arange(max(1, seq.start), t - 1).view(1, -1)
    blocks = build_blocks(ids, labels, [t], anchors, torch.ones_like(anchors, dtype=torch.bool), block_size,
                          draft.config.mask_token_id)
    hidden = draft.forward_train(target.embed_tokens(blocks.input_ids).float(), blocks.positions,
                                 torch.from_numpy(feats).float().unsqueeze(0), torch.arange(t).view(1, -1), blocks.mask)
    return greedy_accept_lengths(hidden, target.lm_head, blocks, vocabs[draft])


def draft_vocab(draft) -> TrainVocab | None:
    """The draft's own vocabulary as the objective ranks over it (the engine does the same)."""
    if draft.vocab is None:
        return None
    marks = torch.zeros(target.config.vocab_size)
    marks[draft.vocab] = 1.0
    return TrainVocab(target.lm_head.weight, marks, draft.vocab.numel())


vocabs = {draft: draft_vocab(draft) for draft in drafts.values()}


for name in args.datasets.split(","):
    prompts, _ = select_subset(load_dataset(name), args.num_prompts, args.seed)
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}],
                                                                 add_generation_prompt=True)) for p in prompts]
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0))
    seqs = [TrainSequence(p + list(o.token_ids), len(p), True) for p, o in zip(prompt_ids, outs)]
    capture = {tuple(d.config.target_layer_ids) for d in drafts.values()}
    feats = {c: [target_features(target, [s], c)[0] for s in seqs] for c in capture}
    for path, draft in drafts.items():
        row = []
        for size in tqdm(sizes, desc=f"{name} {path}", leave=False):
            got = torch.cat([accept_lengths(draft, s, f, y, size)
                             for s, (f, y) in zip(seqs, feats[tuple(draft.config.target_layer_ids)])])
            row.append(f"B={size} tau {got.mean():.3f} ({got.numel()} blocks)")
        print(f"{name:10} {path}: " + ", ".join(row), flush=True)
