"""A request's output as text while it grows: decoded token by token, held back where it may be the start
of a stop string, and cut before the first stop string, with the number of tokens the output then keeps.

A DFlash step commits several tokens at once; a stop string may end at the first of them. The output then
keeps the tokens through the one that completed the stop string, as plain decoding, which would have stopped
there, does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockspec.models.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from blockspec.engine.scheduler import Scheduler
    from blockspec.engine.sequence import Sequence


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
    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self.decoder, self.stops = StreamDecoder(tokenizer), list(stops)
        self.tokens = 0  # tokens pushed so far
        self.text = ""  # text released so far
        self.held = ""  # decoded text held back: it may begin a stop string
        self.stopped = False

    def push(self, tokens: list[int], final: bool = False) -> tuple[str, int | None]:
        """Take the output's next tokens (`final`: they end it): (the text that may be shown now, and, when
        a stop string appeared, how many output tokens to keep: those through the one that completed it)."""
        if self.stopped:
            return "", None
        pending = self.held
        for token in tokens:
            pending += self.decoder.push(token)
            self.tokens += 1
            if self.stops and (piece := self._cut(pending)) is not None:
                return piece, self.tokens
        if final:
            pending += self.decoder.flush()
            if self.stops and (piece := self._cut(pending)) is not None:
                return piece, self.tokens
        hold = 0 if final or not self.stops else find_stop(pending, self.stops)[1]
        piece, self.held = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self.text += piece
        return piece, None

    def _cut(self, pending: str) -> str | None:
        """The text before a stop string in `pending`, released, if one is there."""
        cut, _ = find_stop(pending, self.stops)
        if cut is None:
            return None
        self.stopped, self.held = True, ""
        self.text += pending[:cut]
        return pending[:cut]


def follow_text(scheduler: Scheduler, seq: Sequence, text: TextStream) -> str:
    """Push a request's new tokens through its text and return what may be shown; a stop string ends the
    request there (the tokens after the one that completed it are dropped, as plain decoding never made
    them; a running request is aborted, which frees its KV at once)."""
    piece, keep = text.push(seq.output_ids[text.tokens :], final=seq.finished)
    if keep is not None:
        seq.truncate(keep)
        text.tokens = keep
        if seq.finished:
            seq.finish_reason = "stop"
        else:
            scheduler.abort(seq.seq_id, reason="stop")
    return piece
