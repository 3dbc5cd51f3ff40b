"""Writing a streamed answer to the terminal: its text as tokens are committed, optionally coloured by what
proposed each token (as llama.cpp's speculative example colours accepted draft tokens), the statistics
line after it, and Ctrl-C that stops an answer between two engine steps instead of ending the program."""

from __future__ import annotations

import signal
import sys
from collections import Counter
from typing import TextIO

from blockspec.outputs import RequestOutput, StreamDelta

RESET, DIM = "\033[0m", "\033[2m"
COLORS = {"draft": "\033[32m", "lookup": "\033[36m", "target": ""}  # green, cyan, the terminal's own
LABELS = {"draft": "draft", "lookup": "prompt lookup", "target": "target"}


def legend() -> str:
    return "colours: " + "  ".join(f"{COLORS[s]}{LABELS[s]}{RESET if COLORS[s] else ''}" for s in COLORS)


class Painter:
    """Writes each delta's text; with `color`, piece by piece (`StreamDelta.pieces`: the text token by token)
    in each token's source's colour, so a coloured answer is exactly the plain one."""

    def __init__(self, color: bool, out: TextIO = sys.stdout) -> None:
        self.color, self.out = color, out

    def add(self, delta: StreamDelta) -> None:
        if not self.color:
            self.out.write(delta.text)
        for piece in delta.pieces if self.color else ():
            color = COLORS.get(piece.source, "")
            self.out.write(f"{color}{piece.text}{RESET}" if color and piece.text else piece.text)
        self.out.flush()


def stats_line(out: RequestOutput, interrupted: bool = False) -> str:
    """The answer's statistics: tokens, the draft's tau, the steps taken, decode speed, time to first token,
    prompt tokens the prefix cache held and, for DFlash, where its tokens came from."""
    stats = out.stats
    dflash = out.speculative_algorithm == "DFLASH"
    note = "" if dflash else " (plain decoding: no DFlash draft in use)"
    # tau is undefined, not 0, where nothing was drafted (adaptive speculation or lookup took every step)
    plain = f" + {stats.plain_steps} plain steps" if stats.plain_steps else ""
    if stats.accept_lengths:
        steps = f", tau={stats.mean_accept_length:.2f}"
        steps += f" over {len(stats.accept_lengths)} DFlash steps{plain}" if plain else ""
    else:
        steps = f", no draft steps{f' ({stats.plain_steps} plain steps)' if plain else ''}" if dflash else ""
    if stats.lookup_accept_lengths:
        steps += (f"; {len(stats.lookup_accept_lengths)} prompt-lookup steps "
                  f"(tau {stats.lookup_mean_accept_length:.2f})")
    if stats.merged_accept_lengths:
        steps += (f"; {len(stats.merged_accept_lengths)} copy+draft steps "
                  f"(tau {stats.merged_mean_accept_length:.2f})")
    sources = ""
    if out.speculative_algorithm == "DFLASH" and out.token_sources:
        counts = Counter(source for source, _ in out.token_sources)
        sources = " | " + ", ".join(f"{LABELS[s]} {counts[s]}" for s in LABELS if counts[s])
    stop = ", stopped by Ctrl-C" if interrupted else ""
    cached = ""
    if out.cached_tokens:  # a chat's later turns reuse the earlier turns' KV (the prefix cache)
        cached = f" ({out.cached_tokens} of {out.num_prompt_tokens} prompt tokens cached)"
    return (f"[{out.speculative_algorithm}{note}] {len(out.token_ids)} tokens{stop}{steps}, "
            f"{out.decode_tokens_per_s:.1f} tok/s decode, "
            f"TTFT {out.time_to_first_token_s:.2f}s{cached}{sources}")


class InterruptFlag:
    """Within `with`, Ctrl-C (SIGINT) sets `.set` instead of raising, so a streaming loop can stop its
    request between engine steps and the program carries on; outside, Ctrl-C behaves as usual."""

    def __init__(self) -> None:
        self.set = False

    def __enter__(self) -> InterruptFlag:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.set = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
