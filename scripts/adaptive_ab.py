"""Adaptive speculation vs every-step speculation, side by side in one process (methods interleaved per
prompt, as `blockspec bench` does): plain decoding, then at B=2 and B=4 DFlash with no governor ("raw"),
with tau_alpha 0.3 ("a3") and with the default tau_alpha 0.1 ("a1").

    PYTHONPATH=. python scripts/adaptive_ab.py mt-bench 16 [DRAFT_DIR]    (default: the shipped draft)
"""

import statistics
import sys

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import load_dataset, select_subset
from blockspec.bench.runner import EngineMethod, run_bench
from blockspec.spec.governor import SpecGovernor

torch.set_num_threads(2)
dataset, num_prompts = sys.argv[1], int(sys.argv[2])
draft = sys.argv[3] if len(sys.argv) > 3 else None
llm = LLM(draft_model_path=draft, block_size=4, max_num_seqs=1, max_model_len=2048)
prompts, _ = select_subset(load_dataset(dataset), num_prompts, seed=0)


class Variant(EngineMethod):
    def __init__(self, name: str, size: int | None, governor: SpecGovernor | None) -> None:
        super().__init__(llm, name, "DFLASH" if size else "NONE", size)
        self.governor = governor

    def run(self, ids, params):
        llm.runner.governor = self.governor
        return super().run(ids, params)


methods = [Variant("ar", None, None)]
for size in (2, 4):
    methods += [Variant(f"raw@{size}", size, None), Variant(f"a3@{size}", size, SpecGovernor(tau_alpha=0.3)),
                Variant(f"a1@{size}", size, SpecGovernor())]
samples = run_bench(llm, prompts, methods, SamplingParams(max_tokens=128), progress=False)
base = [s.runs["ar"].tpot_s for s in samples]
for m in methods[1:]:
    tpot = [s.runs[m.name].tpot_s for s in samples]
    accepts = [a for s in samples for a in s.runs[m.name].accept_lengths]
    plain = sum(s.runs[m.name].plain_steps for s in samples)
    match = all(s.runs[m.name].token_ids == s.runs["ar"].token_ids for s in samples)
    print(f"{m.name:8} speedup {statistics.fmean(base) / statistics.fmean(tpot):.3f} "
          f"median {statistics.median(b / t for b, t in zip(base, tpot)):.3f} tau {sum(accepts) / len(accepts):.2f} "
          f"dflash steps {len(accepts)} plain steps {plain} outputs match {match}")
