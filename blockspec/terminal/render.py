"""Writing a streamed answer to the terminal: its text as tokens are committed, optionally coloured by what
proposed each token (as llama.cpp's speculative example colours accepted draft tokens), the statistics
line after it, and Ctrl-C that stops an answer between two engine steps instead of ending the program."""

from __future__ import annotations

import signal
import sys
from collections import Counter
from typing import TextIO

from blockspec.models.tokenizer import StreamDecoder, Tokenizer
from blockspec.outputs import RequestOutput, StreamDelta

RESET, DIM = "\033[0m", "\033[2m"
COLORS = {"draft": "\033[32m", "lookup": "\033[36m", "target": ""}  # green, cyan, the terminal's own
LABELS = {"draft": "draft", "lookup": "prompt lookup", "target": "target"}


def legend() -> str:
    return "colours: " + "  ".join(f"{COLORS[s]}{LABELS[s]}{RESET if COLORS[s] else ''}" for s in COLORS)


class Painter:
    """Writes each delta's text; with `color`, token by token in its source's colour. The text a delta may
    show (`StreamDelta.text`: text that may begin a stop string waits) bounds what is written, so a coloured
    answer ends exactly where the plain one does."""

    def __init__(self, tokenizer: Tokenizer, color: bool, out: TextIO = sys.stdout) -> None:
        self.color, self.out = color, out
        self.decoder = StreamDecoder(tokenizer)
        self.spans: list[tuple[str, str]] = []  # decoded, not yet written: (text, source)
        self.allowed = 0  # characters of text the deltas have released so far
        self.written = 0

    def add(self, delta: StreamDelta) -> None:
        if not self.color:
            self.out.write(delta.text)
            self.out.flush()
            return
        for token, source in zip(delta.token_ids, delta.token_sources):
            self.spans.append((self.decoder.push(token), source))
        if delta.output is not None and self.spans:
            self.spans.append((self.decoder.flush(), self.spans[-1][1]))
        self.allowed += len(delta.text)
        self._write()

    def _write(self) -> None:
        while self.spans and self.written < self.allowed:
            text, source = self.spans[0]
            room = self.allowed - self.written
            shown, rest = text[:room], text[room:]
            if shown:
                color = COLORS.get(source, "")
                self.out.write(f"{color}{shown}{RESET}" if color else shown)
                self.written += len(shown)
            if rest:
                self.spans[0] = (rest, source)
                break
            self.spans.pop(0)
        self.out.flush()


def stats_line(out: RequestOutput, interrupted: bool = False) -> str:
    """The answer's statistics: tokens, the draft's tau, the steps taken, decode speed, time to first token
    and, for DFlash, where its tokens came from."""
    stats = out.stats
    note = "" if out.speculative_algorithm == "DFLASH" else " (plain decoding: no DFlash draft in use)"
    steps = ""
    if stats.plain_steps:
        steps = f" over {len(stats.accept_lengths)} DFlash steps + {stats.plain_steps} plain steps"
    if stats.lookup_accept_lengths:
        steps += (f"; {len(stats.lookup_accept_lengths)} prompt-lookup steps "
                  f"(tau {stats.lookup_mean_accept_length:.2f})")
    sources = ""
    if out.speculative_algorithm == "DFLASH" and out.token_sources:
        counts = Counter(out.token_sources)
        sources = " | " + ", ".join(f"{LABELS[s]} {counts[s]}" for s in LABELS if counts[s])
    stop = ", stopped by Ctrl-C" if interrupted else ""
    return (f"[{out.speculative_algorithm}{note}] {len(out.token_ids)} tokens{stop}, "
            f"tau={out.mean_accept_length:.2f}{steps}, {out.decode_tokens_per_s:.1f} tok/s decode, "
            f"TTFT {out.time_to_first_token_s:.2f}s{sources}")


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
