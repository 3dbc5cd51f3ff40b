"""Adaptive speculation variants side by side in one process (methods interleaved per prompt, as
`blockspec bench` does): plain decoding, then at B=2 and B=4 DFlash with no governor ("raw") and

  --compare tau_alpha (default): the governor with tau_alpha 0.3 ("a3") and the default 0.1 ("a1");
  --compare feeding: the governor with plain steps injecting their draft features at once ("eager", as
      before lazy feeding) and with the backlog injected in one pass before the next DFlash step ("lazy").

    PYTHONPATH=. python scripts/adaptive_ab.py mt-bench 16 [DRAFT_DIR] [--compare feeding]
"""

import argparse
import statistics

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import load_dataset, select_subset
from blockspec.bench.runner import EngineMethod, run_bench
from blockspec.engine.runner import ModelRunner
from blockspec.spec.governor import SpecGovernor

parser = argparse.ArgumentParser()
parser.add_argument("dataset")
parser.add_argument("num_prompts", type=int)
parser.add_argument("draft", nargs="?", default=None)
parser.add_argument("--compare", choices=["tau_alpha", "feeding"], default="tau_alpha")
args = parser.parse_args()
torch.set_num_threads(2)
llm = LLM(draft_model_path=args.draft, block_size=4, max_num_seqs=1, max_model_len=2048)
prompts, _ = select_subset(load_dataset(args.dataset), args.num_prompts, seed=0)


class Variant(EngineMethod):
    def __init__(self, name: str, size: int | None, governor: SpecGovernor | None,
                 max_unfed: int = ModelRunner.MAX_UNFED) -> None:
        super().__init__(llm, name, "DFLASH" if size else "NONE", size)
        self.governor, self.max_unfed = governor, max_unfed

    def run(self, ids, params):
        llm.runner.governor, llm.runner.MAX_UNFED = self.governor, self.max_unfed
        return super().run(ids, params)


methods = [Variant("ar", None, None)]
for size in (2, 4):
    methods.append(Variant(f"raw@{size}", size, None))
    if args.compare == "tau_alpha":
        methods += [Variant(f"a3@{size}", size, SpecGovernor(tau_alpha=0.3)), Variant(f"a1@{size}", size, SpecGovernor())]
    else:
        methods += [Variant(f"eager@{size}", size, SpecGovernor(), max_unfed=1),
                    Variant(f"lazy@{size}", size, SpecGovernor())]
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
