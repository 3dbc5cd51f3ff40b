"""OpenAI request validation and response shapes for /v1/completions and /v1/chat/completions.

Every invalid request becomes an `APIError` (status 400 unless said otherwise) rendered as
`{"error": {"message", "type", "param", "code"}}`. Unknown fields are ignored, as OpenAI does;
fields we cannot honour (n > 1, logprobs, echo, penalties, tools) are refused, never ignored.

Extension fields accepted in requests: `top_k`, `ignore_eos`, `stop_token_ids`.
Extension field on every response (and on the final stream chunk): `blockspec` =
`{speculative_algorithm, block_size, accept_lengths, mean_accept_length, num_verify_steps,
num_plain_steps, lookup_accept_lengths, num_lookup_steps, lookup_mean_accept_length}` (the request's
`RequestStats`), where accept_lengths has one entry per verify step, each counting the bonus token
(1..block_size), and num_plain_steps counts the plain decode steps adaptive speculation took instead,
num_lookup_steps the prompt-lookup steps (their accept lengths are not in accept_lengths: tau stays the
draft's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from blockspec.engine.stats import RequestStats
from blockspec.errors import RequestError
from blockspec.sampling_params import SamplingParams

# OpenAI's default for /v1/completions; chat defaults to the rest of the context
DEFAULT_COMPLETION_MAX_TOKENS = 16
# OpenAI's roles; "developer" is the newer name of "system" (the chat template sees "system")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SEED_RANGE = (-(2**63), 2**64 - 1)  # int64 or uint64: what clients send


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ParsedRequest:
    prompt: str | list[int]  # text to tokenize, or token ids
    max_tokens: int | None  # None: the rest of the context
    params: dict[str, Any]  # SamplingParams fields except max_tokens
    stop: list[str]
    stream: bool
    include_usage: bool


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def text(param: str, value: str) -> str:
    """A string the tokenizer can take: JSON may carry lone UTF-16 surrogates ("\\ud800"), which are not
    text and cannot be encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"'{param}' holds a lone surrogate code point at index {exc.start}; send valid "
                          f"Unicode text.") from exc
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # an int is compared exactly (math.isfinite would overflow on 10**400)
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _int(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise _bad(name, f"'{name}' must be an integer >= {minimum}, got {value!r:.200}.")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        side = "(" if low_open else "["
        raise _bad(name, f"'{name}' must be a number in {side}{low}, {high}], got {value!r:.200}.")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be true or false, got {value!r:.200}.")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise _bad("stop", f"'stop' must be a non-empty string or a list of up to 16 non-empty strings, "
                           f"got {stop!r:.200}.")
    return [text("stop", s) for s in stops]


def _refuse_unsupported(body: dict, chat: bool) -> None:
    if body.get("n") not in (None, 1):
        raise _bad("n", f"n={body['n']!r:.80}: only n=1 is supported; send several requests instead.")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "best_of > 1 is not supported.")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _bad(name, f"{name} is not supported (it would change the target distribution); "
                             f"omit it or send 0.")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _bad("logprobs", "logprobs are not supported by this server.")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported.")
    if not chat and body.get("echo"):
        raise _bad("echo", "echo is not supported.")
    if not chat and body.get("suffix"):
        raise _bad("suffix", "suffix (insertion) is not supported.")
    if chat and (body.get("tools") or body.get("functions")):
        raise _bad("tools", "tool and function calling are not supported.")
    fmt = body.get("response_format")
    if chat and fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only response_format {'type': 'text'} is supported.")


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return text(f"messages[{index}].content", content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise _bad(f"messages[{index}].content",
                           "only text content parts ({'type': 'text', 'text': ...}) are supported.")
            parts.append(text(f"messages[{index}].content", part["text"]))
        return "".join(parts)
    raise _bad(f"messages[{index}].content",
               f"message content must be a string or a list of text parts, got {content!r:.200}.")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {'role', 'content'} objects.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]",
                       f"messages[{i}] must be an object with a string 'role', got {message!r:.200}.")
        role = message["role"]
        if role not in ROLES:
            hint = (" (tool and function calling are not supported)" if role in ("tool", "function") else "")
            raise _bad(f"messages[{i}].role",
                       f"messages[{i}].role={role!r:.80} is not a supported role{hint}; use one of "
                       f"{sorted(ROLES)}.")
        out.append({"role": ROLES[role], "content": _content(message, i)})
    return out


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return text("prompt", prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("prompt", "only one prompt per request is supported; send several requests concurrently.")
    raise _bad("prompt", f"'prompt' must be a non-empty string or a non-empty list of token ids, "
                         f"got {prompt!r:.80}.")


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
    _refuse_unsupported(body, chat)
    prompt = "" if chat else completion_prompt(body)
    max_tokens = _int(body, "max_tokens", 1)
    if chat and max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", 1)
    if not chat and max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise _bad("seed", f"'seed' must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got "
                           f"{seed!r:.80}.")
    top_k = body.get("top_k", 0)
    if top_k is None or top_k == 0:
        top_k = 0
    elif not _is_int(top_k) or top_k < -1:
        raise _bad("top_k", f"'top_k' must be an integer >= 1, or 0 / -1 to disable it, got "
                            f"{top_k!r:.200}.")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise _bad("stop_token_ids",
                   f"'stop_token_ids' must be a list of token ids, got {stop_ids!r:.200}.")
    params = dict(
        temperature=_number(body, "temperature", 1.0, 0.0, 1e6),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, True),
        top_k=top_k, seed=seed, stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos", False),
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options",
                   "'stream_options' must be an object and is only allowed with stream=true.")
    include_usage = _bool(options or {}, "include_usage", False)
    return ParsedRequest(prompt, max_tokens, params, _stop(body), stream, include_usage)


def sampling_params(parsed: ParsedRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **parsed.params)
    except RequestError as exc:
        raise APIError(400, str(exc)) from exc


# ---- responses -------------------------------------------------------------------------------------
def extension(stats: RequestStats, algorithm: str, block_size: int) -> dict:
    return {"speculative_algorithm": algorithm, "block_size": block_size, **stats.summary()}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens the prefix cache held (a part of prompt_tokens)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


def choice(chat: bool, text: str, finish_reason: str | None, stream: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    key, value = (("delta", {"content": text} if text else {}) if stream
                  else ("message", {"role": "assistant", "content": text}))
    return {"index": 0, key: value, "logprobs": None, "finish_reason": finish_reason}


def envelope(chat: bool, stream: bool, rid: str, created: int, model: str, choices: list[dict],
             **extra: Any) -> dict:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **extra}
