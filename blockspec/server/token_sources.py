"""Where each token came from, in the API: the opt-in `return_token_sources` request field.

A completion request (chat or text, streamed or not) with `"return_token_sources": true` gets, in its
choice beside the text, `token_sources`: one entry per output token, in order,
`{"text": str, "source": "draft" | "lookup" | "target", "step": int}`:
- `text`: the token's text. The entries of a chunk (or of the whole response) concatenate to exactly that
  chunk's text (with `echo`, the text after the echoed prompt); a token that completes no character yet, a
  special token such as end-of-turn, or one past the start of a stop string (the output keeps the tokens
  through the one that completed it) has "".
- `source`: "draft" (proposed by the DFlash draft and accepted by the target), "lookup" (copied from the
  context by prompt lookup and accepted), "target" (the target's own token: the one after each step's
  accepted run, every token of a plain step, and the first token).
- `step`: the request's decode step that committed the token: 0 for the first token (from the prompt's
  prefill), then 1, 2, ... for each step, drafted, lookup or plain.
Without the field (or with false) the response is exactly what it is without this feature.
In a stream a token's text is never split over two chunks: where a stop string might begin, the whole
token is held back (the text is held back character by character otherwise; engine/text_stream.py).
"""

from __future__ import annotations

from typing import Any

from blockspec.engine.text_stream import Piece
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


def attach(choice: dict, pieces: list[Piece] | None) -> dict:
    """The choice with its `token_sources` (unchanged when the request did not ask for them)."""
    if pieces is not None:
        choice["token_sources"] = [{"text": p.text, "source": p.source, "step": p.step} for p in pieces]
    return choice
