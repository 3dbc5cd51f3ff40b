"""`blockspec` command line: generate, bench, serve, train-draft. Flag names follow SGLang's."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from blockspec.errors import BlockspecError


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="HF target folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--draft-model-path", "--speculative-draft-model-path", dest="draft_model_path", default=None)
    g.add_argument("--speculative-algorithm", type=str.upper, choices=["DFLASH", "NONE"], default=None)
    g.add_argument(
        "--block-size", "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
        dest="block_size", type=int, default=None,
    )
    g.add_argument("--speculative-dflash-mask-token", dest="mask_token", default=None)
    g.add_argument("--mask-token-id", type=int, default=None)
    g.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="auto")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=True,
                   help="take a plain decode step instead of a DFlash step when the measured step costs and "
                        "acceptance say it is faster (output is identical either way; default: on)")
    g.add_argument("--prompt-lookup-ngram", type=int, default=2, metavar="N",
                   help="DFlash requests: when the context already holds the last N (or more, up to 8) tokens, "
                        "propose what followed them there instead of drafting (spec/lookup.py; output is "
                        "identical either way; 0: off; default: 2)")
    g.add_argument("--prompt-lookup-block-size", type=int, default=None, metavar="W",
                   help="tokens verified per prompt-lookup step, the pending one included (default: max(4, B))")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads (default: torch's choice)")


def set_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            raise BlockspecError(f"--threads={threads} must be >= 1.")
        torch.set_num_threads(threads)


def build_llm(args: argparse.Namespace, **extra):
    from blockspec.llm import LLM

    set_threads(args.threads)
    return LLM(
        model_path=args.model_path, draft_model_path=args.draft_model_path,
        speculative_algorithm=args.speculative_algorithm, block_size=args.block_size,
        mask_token_id=args.mask_token_id, mask_token=args.mask_token, device=args.device,
        dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
        adaptive_speculation=args.adaptive_speculation, prompt_lookup_ngram=args.prompt_lookup_ngram,
        prompt_lookup_block_size=args.prompt_lookup_block_size, **extra,
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens_flag: str = "--max-new-tokens") -> None:
    p.add_argument(max_tokens_flag, dest="max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


DEMO_PROMPT = "Write a Python function that checks whether a number is prime."


def run_generate(args: argparse.Namespace) -> None:
    from blockspec.sampling_params import SamplingParams

    llm = build_llm(args)
    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed,
    )
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    else:
        out = llm.generate(prompt, params)[0]
    report = {
        "text": out.text,
        "token_ids": out.token_ids,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
        "speculative_algorithm": out.speculative_algorithm,
        "block_size": out.block_size,
        "accept_lengths": out.accept_lengths,
        "mean_accept_length": round(out.mean_accept_length, 4),
        "plain_steps": out.plain_steps,
        "lookup_accept_lengths": out.lookup_accept_lengths,
        "time_to_first_token_s": round(out.time_to_first_token_s, 4),
        "decode_tokens_per_s": round(out.decode_tokens_per_s, 3),
    }
    if args.json:
        print(json.dumps(report))
        return
    print(out.text)
    note = "" if out.speculative_algorithm == "DFLASH" else " (plain decoding: no DFlash draft in use)"
    plain = f" over {len(out.accept_lengths)} DFlash steps + {out.plain_steps} plain steps" if out.plain_steps else ""
    if out.lookup_accept_lengths:
        n = len(out.lookup_accept_lengths)
        plain += f"; {n} prompt-lookup steps (tau {sum(out.lookup_accept_lengths) / n:.2f})"
    print(
        f"\n[{out.speculative_algorithm}{note}] {len(out.token_ids)} tokens, "
        f"tau={out.mean_accept_length:.2f}{plain}, {out.decode_tokens_per_s:.1f} tok/s decode, "
        f"TTFT {out.time_to_first_token_s:.2f}s",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_sampling_args(gen)
    add_model_args(gen)
    gen.set_defaults(func=run_generate)

    # Each subsystem adds its own subcommand; imported here so `--help` lists them all.
    from blockspec.bench.cli import register as register_bench
    from blockspec.server.cli import register as register_serve
    from blockspec.train.cli import register as register_train

    for register in (register_bench, register_serve, register_train):
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
