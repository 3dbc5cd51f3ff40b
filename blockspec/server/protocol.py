"""OpenAI request validation for /v1/completions and /v1/chat/completions (responses.py: their shapes).

Every invalid request becomes an `APIError` (status 400 unless said otherwise) rendered as
`{"error": {"message", "type", "param", "code"}}`. Unknown fields are ignored, as OpenAI does;
fields we cannot honour (best_of, logit_bias, suffix, tools, echo with logprobs) are refused, never ignored.

Honoured, each lossless under speculation: `n` choices per prompt, a list of prompts (completions),
`logprobs` / `top_logprobs` (chat) and `logprobs` (completions) from the target's own distribution,
`presence_penalty` / `frequency_penalty` (over the output's tokens, position by position), `echo`
(completions), `stop`, `seed`. Choice i of prompt p has index p * n + i; with a seed, choice i samples with
seed + i.

Extension fields accepted in requests: `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_sources`
(token_sources.py). `usage.prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache held.
Extension field on every response (and on the final stream chunk): `blockspec` =
`{speculative_algorithm, block_size, accept_lengths, mean_accept_length, num_verify_steps,
num_plain_steps, lookup_accept_lengths, num_lookup_steps, lookup_mean_accept_length, merged_accept_lengths,
num_merged_steps, merged_mean_accept_length}` (the request's `RequestStats`, pooled over its choices), where
accept_lengths has one entry per verify step, each counting the bonus token (1..block_size), and
num_plain_steps counts the plain decode steps adaptive speculation took instead, num_lookup_steps the
prompt-lookup steps and num_merged_steps the steps that verified a copy and the draft's candidates as one
tree (their accept lengths are not in accept_lengths: tau stays the draft's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from blockspec.errors import RequestError
from blockspec.sampling_params import SamplingParams

# OpenAI's default for /v1/completions; chat defaults to the rest of the context
DEFAULT_COMPLETION_MAX_TOKENS = 16
# OpenAI's roles; "developer" is the newer name of "system" (the chat template sees "system")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SEED_RANGE = (-(2**63), 2**64 - 1)  # int64 or uint64: what clients send
MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_LOGPROBS = 20


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
    prompts: list[str | list[int]]  # texts to tokenize, or token ids ([""] for chat: the messages are its)
    max_tokens: int | None  # None: the rest of the context
    params: dict[str, Any]  # SamplingParams fields except max_tokens (and seed: see `seed`)
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    seed: int | None = None  # choice i's seed is seed + i
    echo: bool = False  # completions: the prompt's text before each choice's

    @property
    def prompt(self) -> str | list[int]:
        return self.prompts[0]

    @property
    def stop(self) -> list[str]:
        return self.params["stop"]


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
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n"):
        raise _bad("best_of", "best_of (ranking more samples than are returned) is not supported; ask for "
                              "n choices instead.")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported.")
    if not chat and body.get("echo") and body.get("logprobs") not in (None, False):
        raise _bad("echo", "echo together with logprobs (log-probabilities of the prompt's tokens) is not "
                           "supported; send one of them.")
    if not chat and body.get("suffix"):
        raise _bad("suffix", "suffix (insertion) is not supported.")
    if chat and (body.get("tools") or body.get("functions")):
        raise _bad("tools", "tool and function calling are not supported.")
    fmt = body.get("response_format")
    if chat and fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only response_format {'type': 'text'} is supported.")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to report per token (0: only the chosen token's), None: no logprobs."""
    if not chat:  # completions: an integer, the alternatives per token
        value = body.get("logprobs")
        if value is None:
            return None
        if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
            raise _bad("logprobs", f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got "
                                   f"{value!r:.80}.")
        return value
    wanted = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise _bad("top_logprobs", f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got "
                                   f"{top!r:.80}.")
    if top and not wanted:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    return (top or 0) if wanted else None


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


def completion_prompts(body: dict) -> list[str | list[int]]:
    """The prompts of a /v1/completions request: a string, a list of token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad("prompt", f"{len(prompt)} prompts in one request; send at most {MAX_PROMPTS}.")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str) and prompt:
        return text("prompt", prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    raise _bad("prompt", f"'{where}' must be a non-empty string or a non-empty list of token ids, "
                         f"got {prompt!r:.80}.")


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
    _refuse_unsupported(body, chat)
    prompts = [""] if chat else completion_prompts(body)
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
        top_k=top_k, stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos", False),
        stop=_stop(body), presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0), logprobs=_logprobs(body, chat),
    )
    n = _int(body, "n", 1)
    if n is not None and n > MAX_CHOICES:
        raise _bad("n", f"'n' must be an integer in [1, {MAX_CHOICES}], got {n}.")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options",
                   "'stream_options' must be an object and is only allowed with stream=true.")
    include_usage = _bool(options or {}, "include_usage", False)
    echo = not chat and _bool(body, "echo", False)
    return ParsedRequest(prompts, max_tokens, params, stream, include_usage, n or 1, seed, echo)


def sampling_params(parsed: ParsedRequest, max_tokens: int, choice: int = 0) -> SamplingParams:
    """Choice `choice`'s parameters: with a seed, choice i samples with seed + i (wrapped to 64 bits)."""
    seed = parsed.seed
    if seed is not None and choice:
        seed = (seed + choice) % 2**64
    try:
        return SamplingParams(max_tokens=max_tokens, seed=seed, **parsed.params)
    except RequestError as exc:
        raise APIError(400, str(exc)) from exc
