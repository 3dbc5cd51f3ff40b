"""Log-probabilities in OpenAI's two response shapes: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

A token is shown as its own decoded text (special tokens included); a token that holds only part of a
UTF-8 character decodes to U+FFFD, and its `bytes` are those of that text, as in other OpenAI-compatible
servers.
"""

from __future__ import annotations

from typing import Callable

from blockspec.engine.sampler import TokenLogprob

TokenText = Callable[[int], str]  # a token id's text


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> dict:
    return {"content": [{**_entry(token_text(e.token_id), e.logprob),
                         "top_logprobs": [_entry(token_text(t), lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], token_text: TokenText, offset: int = 0) -> dict:
    """`offset`: the text offset of the first token (the echoed prompt's length, or what was sent before)."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(token_text(entry.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**{token_text(t): lp for t, lp in e.top}, text: e.logprob}
                             for e, text in zip(entries, tokens)],
            "text_offset": offsets}
