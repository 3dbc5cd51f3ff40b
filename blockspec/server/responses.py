"""OpenAI's response shapes for /v1/completions and /v1/chat/completions (whole and streamed), with the
`blockspec` extension field (protocol.py describes it) and, when asked, `token_sources` (token_sources.py)."""

from __future__ import annotations

from typing import Any

from blockspec.engine.stats import RequestStats


def extension(stats: RequestStats, algorithm: str, block_size: int) -> dict:
    return {"speculative_algorithm": algorithm, "block_size": block_size, **stats.summary()}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens the prefix cache held (a part of prompt_tokens)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


def choice(chat: bool, text: str, finish_reason: str | None, stream: bool, index: int = 0,
           logprobs: dict | None = None) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    key, value = (("delta", {"content": text} if text else {}) if stream
                  else ("message", {"role": "assistant", "content": text}))
    return {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(chat: bool, stream: bool, rid: str, created: int, model: str, choices: list[dict],
             **extra: Any) -> dict:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **extra}
