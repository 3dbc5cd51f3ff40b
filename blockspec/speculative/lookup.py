"""Prompt lookup: proposals copied from the request's own context, verified like a draft block.

The target's answers often repeat their context: code that restates the prompt's signature and docstring,
names and phrases used before. Measured on SmolLM2's greedy 128-token answers (20 prompts each), 48% of
humaneval positions end a 4-gram that occurs earlier; there the continuation that followed it is right 85%
of the time, while the shipped 3-layer draft gets 49% of them (mt-bench: 82% vs 37%). The draft does not
learn to copy, so when the context has a match the engine proposes the copy instead.

`lookup(tokens, min_ngram, count)` finds the latest earlier occurrence of the longest n-gram
(min_ngram <= n <= MAX_NGRAM) that ends the sequence and returns the `count` tokens that followed it; a
match close to the end continues periodically (its own proposals extend the source), so a repeating
pattern yields a full block. Verification is unchanged, so the output stays exactly the target's: a
proposal is a deterministic token like the draft's argmax (greedy: kept while it equals the target's
choice; sampled: kept with probability p(d)).
"""

from __future__ import annotations

import numpy as np

from blockspec.engine.sequence import Sequence

MAX_NGRAM = 8  # longer matches are tried first: the longer the match, the likelier the copy is right


def lookup(tokens: list[int] | np.ndarray, min_ngram: int, count: int) -> list[int]:
    """`count` proposed next tokens after `tokens` (whose last entry is the pending token), or [] when no
    n-gram of at least `min_ngram` tokens ending there occurred before."""
    seq = np.asarray(tokens, dtype=np.int64)
    last = seq.shape[0] - 1
    if min_ngram < 1 or count < 1 or last < min_ngram:
        return []
    ends = np.flatnonzero(seq[:last] == seq[last])  # candidate match ends j < last with seq[j] == seq[last]
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # matched n-gram length ending at each candidate
    alive = np.ones(ends.size, dtype=bool)
    for k in range(1, min(MAX_NGRAM, last + 1)):
        alive &= ends >= k
        alive[alive] = seq[ends[alive] - k] == seq[last - k]
        if not alive.any():
            break
        length += alive
    best = length.max()
    if best < min_ngram:
        return []
    j = int(ends[np.flatnonzero(length == best)[-1]])  # the latest of the longest matches
    source = seq[j + 1 : j + 1 + count].tolist()  # what followed the match (at most up to the pending token)
    while len(source) < count:  # the match overlaps the end: the pattern repeats with period last - j
        source.append(source[len(source) - (last - j)])
    return source


def lookups(seqs: list[Sequence], min_ngram: int, count: int) -> list[list[int]]:
    """Each row's `count` proposals copied from its own context, or [] where the context has no match."""
    return [lookup(s.prompt_ids + s.output_ids, min_ngram, count) for s in seqs]
