"""What a plain decode step of a DFlash request costs (it captures the target's features for the draft, so
adaptive speculation can resume; since lazy feeding they wait on the sequence and are injected 64 at a
time here, as no DFlash step comes), vs an ordinary plain step.
Interleaved, 5 timed repetitions of 128 tokens each, medians.

    PYTHONPATH=. python scripts/fed_plain_bench.py [DRAFT_DIR]    (default: the shipped draft)
"""

import statistics
import sys

import torch

from blockspec import LLM, SamplingParams
from blockspec.spec.governor import SpecGovernor

torch.set_num_threads(2)


class AlwaysPlain(SpecGovernor):
    def speculate(self, seqs, block_size):
        return False


llm = LLM(draft_model_path=sys.argv[1] if len(sys.argv) > 1 else None, max_num_seqs=1, max_model_len=1024)
llm.runner.governor = AlwaysPlain()
prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash table works, in detail."}])
params = SamplingParams(max_tokens=128, ignore_eos=True)
ms: dict[str, list[float]] = {"NONE": [], "DFLASH": []}
for rep in range(6):  # the first repetition warms up
    for algorithm in ms:
        out = llm.generate([prompt], params, speculative_algorithm=algorithm)[0]
        if rep:
            ms[algorithm].append(out.decode_time_s / (len(out.token_ids) - 1) * 1e3)
plain, fed = statistics.median(ms["NONE"]), statistics.median(ms["DFLASH"])
print(f"plain step {plain:.2f} ms, plain step feeding the draft {fed:.2f} ms: {fed / plain:.3f}x")
