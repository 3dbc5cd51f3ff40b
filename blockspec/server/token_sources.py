"""Where each token came from, in the API: the opt-in `return_token_sources` request field.

A completion request (chat or text, streamed or not) with `"return_token_sources": true` gets, in its
choice beside the text, `token_sources`: one entry per output token, in order,
`{"text": str, "source": "draft" | "lookup" | "target", "step": int}`:
- `text`: the token's text. The entries of a chunk (or of the whole response) concatenate to exactly that
  chunk's text; a token that completes no character yet, or a special token such as end-of-turn, has "".
- `source`: "draft" (proposed by the DFlash draft and accepted by the target), "lookup" (copied from the
  context by prompt lookup and accepted), "target" (the target's own token: the one after each step's
  accepted run, every token of a plain step, and the first token).
- `step`: the request's decode step that committed the token: 0 for the first token (from the prompt's
  prefill), then 1, 2, ... for each step, drafted, lookup or plain.
Without the field (or with false) the response is exactly what it is without this feature.
In a stream a token's text is never split over two chunks: where a stop string might begin, the whole
token is held back (the text is held back character by character otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockspec.server.protocol import APIError

REQUEST_FIELD = "return_token_sources"


def requested(body: Any) -> bool:
    """Whether the request asks for token sources (a non-boolean value is a 400 naming the field)."""
    value = body.get(REQUEST_FIELD) if isinstance(body, dict) else None
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{REQUEST_FIELD}' must be true or false, got {value!r:.80}.",
                       param=REQUEST_FIELD)
    return value


@dataclass
class Piece:
    """One token's text and origin."""

    text: str
    source: str
    step: int

    def json(self) -> dict:
        return {"text": self.text, "source": self.source, "step": self.step}


def attach(choice: dict, pieces: list[Piece] | None) -> dict:
    """The choice with its `token_sources` (unchanged when the request did not ask for them)."""
    if pieces is not None:
        choice["token_sources"] = [p.json() for p in pieces]
    return choice


class PieceStream:
    """A request's token pieces on their way out: cut by a stop string and held back at a possible stop
    string's start like its text, a token at a time."""

    def __init__(self) -> None:
        self.held: list[Piece] = []

    def take(self, texts: list[str], tail: str, origins: list[tuple[str, int]], keep: int | None,
             cut: bool) -> tuple[list[Piece], str, str]:
        """`texts`: the new tokens' texts, `origins` their (source, step); `tail`: text the decoder flushed
        at the end of generation (it belongs to the last token). Of the held pieces and the new ones, the
        first `keep` characters go out now (None: all); past them the rest is dropped if `cut` (a stop
        string starts there), else held back from the token that holds character `keep` on.
        Returns (pieces to send, their text, the text now held back)."""
        pieces = self.held + [Piece(text, source, step) for text, (source, step) in zip(texts, origins)]
        if tail and pieces:  # with no piece at all the request failed: its text is not sent
            pieces[-1].text += tail
        self.held = []
        send = pieces
        if keep is not None:
            send, at = [], 0
            for i, piece in enumerate(pieces):
                if cut and at >= keep:
                    break
                if at + len(piece.text) <= keep:
                    send.append(piece)
                    at += len(piece.text)
                    continue
                if cut:
                    send.append(Piece(piece.text[: keep - at], piece.source, piece.step))
                else:
                    self.held = pieces[i:]
                break
        return send, "".join(p.text for p in send), "".join(p.text for p in self.held)
