"""How long ranking the draft's proposals takes over the full LM head vs over the draft's vocabulary.

    PYTHONPATH=. python scripts/draft_vocab_bench.py [DRAFT]   (default drafts/smollm2-run5)

Both int8 heads are built once; the two calls are interleaved, 300 rounds, medians. One row is a B=2 step,
three rows a B=4 step. Needs a CPU with bf16 units (the int8 head), like the engine's fast path.
"""

import statistics
import sys
import time

import torch

from blockspec.llm import LLM

torch.set_num_threads(2)
runner = LLM(draft_model_path=sys.argv[1] if len(sys.argv) > 1 else "drafts/smollm2-run5", block_size=2).runner
vocab, full = runner.draft.vocab, runner.argmax_head
if vocab is None or full is None:
    sys.exit("needs a draft with a draft_vocab tensor and a CPU with bf16 units (the int8 LM head)")
sub = full.rows(vocab)
for rows in (1, 3):
    h = torch.randn(rows, full.qweight.shape[1])
    times: dict[str, list[float]] = {"full head": [], f"draft vocabulary ({vocab.numel()})": []}
    for _ in range(300):
        for (name, samples), rank in zip(times.items(), (lambda: full.scores(h).argmax(-1),
                                                           lambda: vocab[sub.scores(h).argmax(-1)])):
            start = time.perf_counter()
            rank()
            samples.append(time.perf_counter() - start)
    print(f"{rows} row(s): " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items()))
