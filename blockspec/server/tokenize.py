"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt (or chat messages, rendered by the chat
template) to its token ids, and token ids back to text."""

from __future__ import annotations

from typing import Any

from blockspec.errors import BlockspecError
from blockspec.server.protocol import APIError, _bool, _is_int, chat_messages, text


def tokenize(llm, body: Any) -> dict:
    """{"prompt": str} or {"messages": [...], "add_generation_prompt": true} -> {"tokens", "count",
    "max_model_len"}; `add_special_tokens` (default true for a prompt) adds the tokenizer's own (a BOS)."""
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "Send either 'prompt' (a string) or 'messages' (a chat), not both or neither.",
                       param="prompt")
    try:
        if "messages" in body:
            prompt = llm.tokenizer.apply_chat_template(
                chat_messages(body), add_generation_prompt=_bool(body, "add_generation_prompt", True))
            special = _bool(body, "add_special_tokens", False)
        else:
            if not isinstance(body["prompt"], str):
                raise APIError(400, f"'prompt' must be a string, got {body['prompt']!r:.80}.", param="prompt")
            prompt = text("prompt", body["prompt"])
            special = _bool(body, "add_special_tokens", True)
        tokens = llm.tokenizer.encode(prompt, add_special_tokens=special)
    except BlockspecError as exc:
        raise APIError(400, str(exc), param="messages" if "messages" in body else "prompt") from exc
    return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}


def detokenize(llm, body: Any) -> dict:
    """{"tokens": [ids]} -> {"prompt": text} (special tokens kept)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = llm.target.config.vocab_size
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < vocab for t in tokens):
        raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab}), got {tokens!r:.120}.",
                       param="tokens")
    return {"prompt": llm.tokenizer.decode(tokens, skip_special_tokens=False)}
