"""llama.cpp as a peer in `blockspec bench --baseline llama.cpp`: the same GGUF, the same prompt token ids
(our chat template), through llama-cpp-python, timed as our own methods are (decode-only: first new token to
last), interleaved with them in one process.

llama.cpp is an optional extra (`pip install llama-cpp-python==0.3.36`, built from source: a few minutes),
never needed to run or test blockspec. Its CPU kernels quantize activations to 8 bits for block-quantized
weights, so its greedy tokens can differ from the target's exact ones; the report says how often.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from blockspec.bench.runner import RunStats
from blockspec.errors import BlockspecError
from blockspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from blockspec.llm import LLM

INSTALL = "pip install llama-cpp-python==0.3.36"


class LlamaCppMethod:
    name = "llama.cpp"

    def __init__(self, llm: LLM, gguf: Path, threads: int) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise BlockspecError(f"--baseline llama.cpp needs llama-cpp-python, an optional extra built "
                                 f"from source: {INSTALL}.") from exc
        self.llm = llm
        self.model = Llama(model_path=str(gguf), n_ctx=llm.max_model_len, n_threads=threads,
                           n_threads_batch=threads, n_batch=512, seed=0, verbose=False)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RunStats:
        sampling = dict(temp=0.0, top_k=1) if params.greedy else dict(
            temp=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
        if not params.greedy and params.seed is not None:
            self.model.set_seed(params.seed)
        self.model.reset()
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        for token in self.model.generate(prompt_ids, repeat_penalty=1.0, reset=True, **sampling):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) >= params.max_tokens or token in self.llm.stop_ids:
                break
        end = time.perf_counter()
        first = first if first is not None else end
        return RunStats(tokens, self.llm.tokenizer.decode(tokens), first - start, end - first)
