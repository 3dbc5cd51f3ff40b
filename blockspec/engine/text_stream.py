"""A request's output as text while it grows: decoded token by token, held back where it may be the start
of a stop string, and cut before the first stop string, with the number of tokens the output then keeps.

A DFlash step commits several tokens at once; a stop string may end at the first of them. The output then
keeps the tokens through the one that completed the stop string, as plain decoding, which would have stopped
there, does.

The released text also comes as `Piece`s: each token's text with where the token came from
(`Sequence.token_sources`), for the terminal's colours and the API's `return_token_sources`. The pieces of a
release concatenate to exactly its text; with `whole_tokens` a token's text is never split over two
releases (where a stop string may begin, the whole token waits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockspec.models.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from blockspec.engine.scheduler import Scheduler
    from blockspec.engine.sequence import Sequence


@dataclass
class Piece:
    """Released text of one output token and its origin (Sequence.token_sources): "draft", "lookup" or
    "target", and the decode step that committed it. A token that completes no character yet, a special
    token, or one after the start of a stop string has ""."""

    text: str
    source: str
    step: int


def find_stop(text: str, stops: list[str]) -> tuple[int | None, int]:
    """(index where the earliest stop string starts or None, length of the longest suffix of text
    that is a proper prefix of some stop string: text that must be held back for now)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), 0
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return None, hold


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: list[str], whole_tokens: bool = False) -> None:
        self.decoder, self.stops, self.whole_tokens = StreamDecoder(tokenizer), list(stops), whole_tokens
        self.tokens = 0  # tokens pushed so far
        self.text = ""  # text released so far
        # Decoded, not yet released (it may begin a stop string): [output index, text] per token
        self.held: list[list] = []
        self.stopped = False

    def push(self, tokens: list[int], final: bool = False) -> tuple[list[tuple[int, str]], int | None]:
        """Take the output's next tokens (`final`: they end it): (the text that may be shown now, as
        (output index, text) per token, and, when a stop string appeared, how many output tokens to keep:
        those through the one that completed it)."""
        if self.stopped:
            return [], None
        pending = self.held
        for token in tokens:
            pending.append([self.tokens, self.decoder.push(token)])
            self.tokens += 1
            if self.stops and (cut := find_stop(_joined(pending), self.stops)[0]) is not None:
                return self._release(pending, cut, stop=True), self.tokens
        if final:
            tail = self.decoder.flush()  # it belongs to the last token
            if tail and pending:
                pending[-1][1] += tail
            elif tail:
                pending.append([self.tokens - 1, tail])
            if self.stops and (cut := find_stop(_joined(pending), self.stops)[0]) is not None:
                return self._release(pending, cut, stop=True), self.tokens
        text = _joined(pending)
        hold = 0 if final or not self.stops else find_stop(text, self.stops)[1]
        return self._release(pending, len(text) - hold, stop=False), None

    def _release(self, pending: list[list], keep: int, stop: bool) -> list[tuple[int, str]]:
        """Release the first `keep` characters of the pending tokens' text; the rest is dropped after a stop
        string (its tokens stay, with no text), else held back (whole tokens with `whole_tokens`)."""
        out, at, self.held = [], 0, []
        for i, (index, text) in enumerate(pending):
            if at + len(text) <= keep:
                out.append((index, text))
                at += len(text)
            elif stop:
                out.append((index, text[: max(keep - at, 0)]))
                at = keep
            else:
                if not self.whole_tokens and keep > at:
                    out.append((index, text[: keep - at]))
                    text, at = text[keep - at :], keep
                self.held = [[index, text]] + pending[i + 1 :]
                break
        self.stopped = stop
        self.text += "".join(text for _, text in out)
        return out


def _joined(pending: list[list]) -> str:
    return "".join(text for _, text in pending)


def follow_text(scheduler: Scheduler, seq: Sequence, text: TextStream) -> list[Piece]:
    """Push a request's new tokens through its text and return what may be shown; a stop string ends the
    request there (the tokens after the one that completed it are dropped, as plain decoding never made
    them; a running request is aborted, which frees its KV at once)."""
    released, keep = text.push(seq.output_ids[text.tokens :], final=seq.finished)
    pieces = [Piece(piece, *seq.token_sources[index]) for index, piece in released]
    if keep is not None:
        seq.truncate(keep)
        text.tokens = keep
        if seq.finished:
            seq.finish_reason = "stop"
        else:
            scheduler.abort(seq.seq_id, reason="stop")
    return pieces
