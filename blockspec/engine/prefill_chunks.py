"""How a step's prefill is cut: the share of prompt tokens it may run beside the decoding rows, and which
rows of chunks run in one padded forward (engine/scheduler.py, step 4)."""

from __future__ import annotations

from blockspec.engine.sequence import Sequence

MIN_PREFILL_CHUNK = 4  # a prompt still advances this much per step beside any decode batch
# A prompt token at context length c also attends over c keys: it costs about 1 + c / ATTENTION_KEYS
# decode rows (on SmolLM2 on 2 CPU cores, a 16-token chunk at 3,900 tokens of context took ~4 decode
# steps, at the start of a prompt under one).
ATTENTION_KEYS = 512

Row = tuple[Sequence, list[int]]  # a sequence and the prompt ids its chunk prefills


def prefill_share(ratio: float, decode_rows: int, context: int) -> int:
    """Prompt tokens beside `decode_rows` verified rows: `ratio` times them, fewer at a prompt's `context`
    (each token also attends over it), at least MIN_PREFILL_CHUNK."""
    return max(MIN_PREFILL_CHUNK, int(ratio * decode_rows / (1 + context / ATTENTION_KEYS)))


def prefill_groups(rows: list[Row], max_len: int) -> list[list[Row]]:
    """Rows whose chunk lengths share a power-of-two bucket run in one padded forward (padding wastes
    under 2x); a row whose padding would run past its slab (`max_len` rows) goes alone."""
    buckets: dict[int, list[Row]] = {}
    for row in rows:
        buckets.setdefault(len(row[1]).bit_length(), []).append(row)
    groups: list[list[Row]] = []
    for bucket in buckets.values():
        width = max(len(c) for _, c in bucket)
        fits = [r for r in bucket if r[0].num_cached + width <= max_len]
        groups += [fits] if fits else []
        groups += [[r] for r in bucket if r[0].num_cached + width > max_len]
    return groups
