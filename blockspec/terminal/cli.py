"""`blockspec generate` (one answer, streamed as it is decoded, or one JSON object) and `blockspec chat` (an
interactive conversation: chat.py).

The prompt: the PROMPT argument; `-` (or no argument with standard input not a terminal) reads it from
standard input; none at all uses a demo prompt, said on stderr. A target with a chat template gets the prompt
as a user message in it (as `llama-cli` and `ollama run` do); `--raw` sends the text as it is, and a target
without a template always gets it raw.
"""

from __future__ import annotations

import argparse
import json
import sys

from blockspec.errors import BlockspecError

DEMO_PROMPT = "Write a Python function that checks whether a number is prime."


def add_common(p: argparse.ArgumentParser, max_tokens: int) -> None:
    from blockspec.engine_flags import add_model_args
    from blockspec.sampling_params import add_sampling_args

    p.add_argument("--color", action="store_true",
                   help="colour each token by what proposed it: the draft (green), prompt lookup (cyan) or "
                        "the target itself (plain)")
    add_sampling_args(p, max_tokens=max_tokens, extras=True)
    add_model_args(p)


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate an answer to one prompt, printed as it is decoded",
                         description="Generate an answer to one prompt: its text streams as the engine "
                                     "commits tokens, then a line of statistics on stderr (--json: one JSON "
                                     "object instead). The prompt: PROMPT, '-' for standard input, or what "
                                     "is piped in. A model with a chat template gets it as a user message in "
                                     "the template (as llama-cli and ollama run do); --raw sends it as is.")
    gen.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                     help="the prompt; '-' reads it from standard input (default: standard input when it "
                          "is not a terminal, else a demo prompt)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the model's chat template; an error if it has none "
                           "(default: on when the model has a template)")
    mode.add_argument("--raw", action="store_true",
                      help="send the prompt as it is, without the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object on stdout when done (text, token ids, statistics) "
                          "instead of streaming the text")
    add_common(gen, max_tokens=128)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="an interactive conversation in the terminal, answers streamed",
                          description="Talk to the model: each answer streams as it is decoded, followed "
                                      "by a line of statistics. /clear starts over, /exit (or Ctrl-D) quits, "
                                      "Ctrl-C stops an answer.")
    chat.add_argument("--system", default=None, metavar="TEXT",
                      help="a system message that opens the conversation (default: none)")
    add_common(chat, max_tokens=512)
    chat.set_defaults(func=run_chat)


def read_prompt(given: str | None) -> str:
    """The prompt to use: given, from standard input, or the demo prompt (said on stderr)."""
    if given == "-" or (given is None and sys.stdin is not None and not sys.stdin.isatty()):
        text = sys.stdin.read()
        if text.strip():
            return text.rstrip("\n")
        if given == "-":
            raise BlockspecError("The prompt read from standard input is empty: pipe some text in, or give "
                                 "PROMPT as an argument.")
    if given is None:  # no argument, and nothing piped in (a terminal, or empty input as under make)
        print(f"blockspec: no prompt given; using the demo prompt: {DEMO_PROMPT!r}", file=sys.stderr)
        return DEMO_PROMPT
    if not given.strip():
        raise BlockspecError("PROMPT is empty: give some text, or '-' to read it from standard input.")
    return given


def run_generate(args: argparse.Namespace) -> None:
    from blockspec.config import EngineConfig
    from blockspec.sampling_params import sampling_from_args

    params = sampling_from_args(args)  # every value checked before anything loads
    config = EngineConfig.from_args(args)
    prompt = read_prompt(args.prompt)
    from blockspec.llm import LLM
    from blockspec.terminal.render import Painter, legend, stats_line

    llm = LLM(config)
    if args.chat or (not args.raw and llm.tokenizer.chat_template is not None):
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    if args.json:
        out = llm.generate(prompt, params)[0]
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": out.num_prompt_tokens,
            "num_output_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "speculative_algorithm": out.speculative_algorithm, "block_size": out.block_size,
            **out.stats.summary(), "time_to_first_token_s": round(out.time_to_first_token_s, 4),
            "decode_tokens_per_s": round(out.decode_tokens_per_s, 3), "cached_tokens": out.cached_tokens,
            "token_sources": [list(origin) for origin in out.token_sources],
        }))
        return
    if args.color:
        print(legend(), file=sys.stderr)
    painter = Painter(args.color)
    for delta in llm.stream(prompt, params):
        painter.add(delta)
        if delta.output is not None:
            print()
            print(f"\n{stats_line(delta.output)}", file=sys.stderr)


def run_chat(args: argparse.Namespace) -> None:
    from blockspec.terminal.chat import chat

    chat(args)
