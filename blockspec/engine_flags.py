"""The command line's model and engine flags, each setting the `EngineConfig` field of its dest (config.py
validates them; flag names follow SGLang's)."""

from __future__ import annotations

import argparse

from blockspec.config import (ACCEPT_RULES, ALGORITHMS, CPU_ACTIVATIONS, DEFAULT_CPU_ACTIVATIONS,
                              DRAFT_QUANTIZATIONS, MERGE_RULES, QUANTIZATIONS, TREE_RULES)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, metavar="DIR",
                   help="HF target folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--draft-model-path", "--speculative-draft-model-path", dest="draft_model_path",
                   default=None, metavar="DIR",
                   help="DFlash draft folder, z-lab format, or 'default': the shipped draft of the embedded "
                        "target (default: that draft for the embedded target, none for another)")
    g.add_argument("--speculative-algorithm", type=str.upper, choices=list(ALGORITHMS), default=None,
                   help="DFLASH: speculate with the draft; NONE: plain decoding (default: DFLASH when a "
                        "draft is in use)")
    g.add_argument("--block-size", "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
                   dest="block_size", type=int, default=None, metavar="B",
                   help="tokens per DFlash block, the pending one included (default: the draft's own)")
    g.add_argument("--speculative-dflash-mask-token", dest="mask_token", default=None, metavar="TOKEN",
                   help="the draft's mask token by its text (default: the draft config's)")
    g.add_argument("--mask-token-id", type=int, default=None, metavar="ID",
                   help="the draft's mask token by its id (default: the draft config's)")
    g.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="where to run (auto: CUDA when visible, else the CPU)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="auto",
                   help="activation and dense-weight dtype (auto: float32 on the CPU, bfloat16 on CUDA)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampled tokens, reproducible whatever the schedule (default: random)")
    g.add_argument("--quantization", choices=list(QUANTIZATIONS), default="auto",
                   help="the target's weights on the CPU: GGUF blocks (auto: the "
                        "embedded model's own Q4_1/Q8_0 blocks; a type: every linear layer in it), "
                        "or none: dense fp32 (default: auto)")
    g.add_argument("--draft-quantization", choices=list(DRAFT_QUANTIZATIONS), default="auto",
                   help="the draft's linear layers on the CPU: blocks of a type, quantized from its "
                        "checkpoint at load, or none: dense (default: auto, q8_0 when the target holds "
                        "blocks)")
    g.add_argument("--cpu-activations", choices=list(CPU_ACTIVATIONS), default="auto",
                   help="how block weights meet activations on the CPU: int8 (each row quantized to blocks "
                        "of 32, integer dot products: fastest), fp32 (the exact reference), or auto "
                        f"(default: auto, which is {DEFAULT_CPU_ACTIVATIONS}); dense weights are unaffected")
    g.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=True,
                   help="take a plain decode step instead of a DFlash step when the measured step costs and "
                        "acceptance say it is faster (output is identical either way; default: on)")
    g.add_argument("--prompt-lookup-ngram", type=int, default=2, metavar="N",
                   help="DFlash requests: when the context already holds the last N (or more, up to 8) "
                        "tokens, propose what followed them there instead of drafting (output is identical "
                        "either way; 0: off; default: 2)")
    g.add_argument("--prompt-lookup-block-size", type=int, default=None, metavar="W",
                   help="tokens verified per prompt-lookup step, the pending one included "
                        "(default: max(4, B))")
    g.add_argument("--prompt-lookup-merge", choices=list(MERGE_RULES), default="auto",
                   help="verify a request's context copy and the draft's candidates in one pass as one tree, "
                        "keeping whichever the target agrees with: auto (where adaptive speculation measures "
                        "it faster; without it: never), always (whenever a copy exists) or never (output is "
                        "identical either way; default: auto)")
    g.add_argument("--speculative-tree-budget", type=int, default=0, metavar="N",
                   help="DFlash steps may verify a tree of N candidate tokens built from the draft's top "
                        "choices per block position instead of its chain alone; adaptive speculation "
                        "takes the tree only where it measures faster (output is identical either way; "
                        "0: chain only; default 0)")
    g.add_argument("--speculative-tree-topk", type=int, default=4, metavar="K",
                   help="a tree's tokens per block position, at most; for a DFlash2 draft the beam's "
                        "prefixes per depth (default 4)")
    g.add_argument("--speculative-tree-rule", choices=list(TREE_RULES), default="best-first",
                   help="best-first: the N most probable prefixes; spine-first: the draft's chain first "
                        "(never accepts less than it), then the most probable others (default best-first)")
    g.add_argument("--speculative-accept", choices=list(ACCEPT_RULES), default="match",
                   help="how sampled requests judge the draft: match (the draft proposes its argmax, kept "
                        "with probability p; a seed gives plain decoding's exact tokens) or rejection (the "
                        "draft samples from its distribution q, kept with probability min(1, p/q), else a "
                        "draw from the residual; the same distribution, other tokens; default match)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length in tokens (default: the target's, at most 4096)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads, at most the CPUs this process may use (its affinity mask and cgroup "
                        "quota; more are capped, with a warning) (default: those CPUs, and between engine "
                        "steps only those other processes leave free; with --tp-size on the CPU, shared out "
                        "among the ranks)")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks: the engine starts them itself, or runs as one of them under "
                        "torchrun (default 1)")
    g.add_argument("--tp-backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="torch.distributed backend for --tp-size > 1 (auto: gloo on the CPU, NCCL on CUDA; "
                        "default auto)")


def add_serving_args(p: argparse.ArgumentParser, default_running: int) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-running-requests", dest="max_num_seqs", type=int, default=default_running,
                   help=f"requests decoded together, one KV slot each (default {default_running}"
                        f"{': as many as the highest concurrency' if not default_running else ''})")
    g.add_argument("--max-total-tokens", "--kv-budget-tokens", dest="max_total_tokens", type=int,
                   default=None,
                   help="KV memory budget in tokens, shared by target and draft caches (each token is one "
                        "row in both); when running requests outgrow it the youngest is preempted and "
                        "recomputed later (default: every slot can hold a full-context request, so nothing "
                        "is ever preempted)")
    g.add_argument("--disable-prefix-caching", "--disable-radix-cache", dest="prefix_caching",
                   action="store_false",
                   help="do not keep computed prompt prefixes for later requests; kept, a request "
                        "starting with tokens a finished or running request computed reuses their K/V, "
                        "target and draft, and prefills only the rest (default: kept; the output is the "
                        "same either way)")
    g.add_argument("--prefill-tokens-per-step", type=int, default=None,
                   help="prompt tokens prefilled per engine step (default 512)")
    g.add_argument("--prefill-decode-ratio", type=float, default=None, metavar="R",
                   help="while requests decode, a step prefills at most R tokens per row it verifies (at "
                        "least 16), so a long prompt delays the running streams by about R decode steps' "
                        "worth of rows per step (default 2; 0: every step prefills "
                        "--prefill-tokens-per-step)")
