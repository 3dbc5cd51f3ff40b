"""`blockspec chat`: a conversation in the terminal. Each answer streams as the engine commits its tokens
(coloured by source with --color), then a line of statistics; the conversation so far is the next prompt,
rendered by the target's chat template. Commands: /clear, /exit (or /quit, Ctrl-D), /help. Ctrl-C stops
an answer (the part said so far stays in the conversation); at the prompt it only reminds how to leave.
When the conversation outgrows the context, its oldest turns are dropped, and it says so.
"""

from __future__ import annotations

import argparse
import sys

from blockspec.errors import BlockspecError

HELP = "/clear starts over, /exit (or Ctrl-D) quits; Ctrl-C stops an answer."
EXITS = ("/exit", "/quit", "/bye")


def chat(args: argparse.Namespace) -> None:
    from blockspec.config import EngineConfig
    from blockspec.sampling_params import sampling_from_args

    params = sampling_from_args(args)  # every value checked before anything loads
    config = EngineConfig.from_args(args)
    if not sys.stdin.isatty():
        raise BlockspecError("blockspec chat talks with a person at a terminal; for one answer to piped "
                             "input use `blockspec generate -`.")
    from blockspec.llm import LLM
    from blockspec.terminal.render import InterruptFlag, Painter, legend, stats_line

    llm = LLM(config)
    if llm.tokenizer.chat_template is None:
        raise BlockspecError(f"The model at {llm.model_path} has no chat template, so it cannot hold a "
                             f"conversation; use `blockspec generate --raw` instead.")
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    name = llm.model_path.name
    print(f"blockspec chat: {name} ({llm.speculative_algorithm}, block {llm.block_size}). {HELP}",
          file=sys.stderr)
    if args.color:
        print(legend(), file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D quits)", file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in EXITS:
            return
        if text == "/clear":
            messages = list(opening)
            print("(the conversation starts over)", file=sys.stderr)
            continue
        if text in ("/help", "/?"):
            print(HELP, file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        painter, stopped, output = Painter(args.color), InterruptFlag(), None
        try:
            prompt = fit(llm, messages, opening, params.max_tokens)
            with stopped:
                for delta in llm.stream(prompt, params, should_stop=lambda: stopped.set):
                    painter.add(delta)
                    output = delta.output or output
        except BlockspecError as exc:  # this message's problem: the conversation goes on without it
            messages.pop()
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        print()
        if output is not None:
            messages.append({"role": "assistant", "content": output.text})
            print(f"{stats_line(output, interrupted=stopped.set)}\n", file=sys.stderr)


def fit(llm, messages: list[dict], opening: list[dict], max_tokens: int) -> str:
    """The conversation's prompt, its oldest turns dropped (in place) while it and an answer of max_tokens
    would not fit the context."""
    while True:
        prompt = llm.chat_prompt(messages)
        length = len(llm.tokenizer.encode(prompt))
        if length + max_tokens <= llm.max_model_len:
            return prompt
        turns = len(messages) - len(opening)
        if turns <= 1:
            raise BlockspecError(f"This message and an answer of up to {max_tokens} tokens do not fit the "
                                 f"context of {llm.max_model_len} tokens ({length} tokens before the "
                                 f"answer). Send a shorter message or lower --max-new-tokens.")
        del messages[len(opening) : len(opening) + 2]  # the oldest exchange
        print(f"(the oldest exchange was dropped: the conversation outgrew the {llm.max_model_len}-token "
              f"context)", file=sys.stderr)
