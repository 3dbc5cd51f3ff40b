"""Tokenizer for any Hugging Face checkpoint folder (tokenizer.json + tokenizer_config.json), with
the chat template rendered the way transformers renders it, and a streaming detokenizer."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from blockspec.errors import ModelLoadError, RequestError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}). Re-download or rewrite it.") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    # Newer transformers save the template beside the config; older ones put it inside it.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer`; all ids include added tokens."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None,
                 generation_eos: list[int], source: str = "<memory>") -> None:
        self._tok = backend
        self.source = source
        self.chat_template = chat_template
        self.special_tokens = {
            name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        if chat_template is not None and "<|im_end|>" in chat_template:  # ChatML turns end here
            eos.add(self._id_of("<|im_end|>"))
        eos.update(generation_eos)
        eos.discard(None)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._template: Any = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path} is missing: blockspec needs the fast-tokenizer file tokenizer.json. Fix: copy it "
                f"from the original checkpoint, or create it with transformers: "
                f"AutoTokenizer.from_pretrained({str(folder)!r}).save_pretrained({str(folder)!r})."
            )
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path} could not be parsed by the tokenizers library ({exc}).") from exc
        config = _read_json(folder / "tokenizer_config.json")
        eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos_list = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
        return cls(backend, config, _find_chat_template(folder, config), eos_list, source=str(folder))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"prompt must be a string, got {type(text).__name__}.")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the checkpoint's template, as transformers'
        apply_chat_template(tokenize=False)."""
        if self.chat_template is None:
            raise RequestError(
                f"The model at {self.source} has no chat template (none in tokenizer_config.json or "
                f"chat_template.jinja), so chat messages cannot be formatted. Send a plain prompt instead."
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages must be a list of objects, each with a 'role' and 'content'.")
        import jinja2

        if self._template is None:
            try:
                self._template = _chat_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ModelLoadError(f"The chat template of {self.source} does not parse: {exc}.") from exc
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens,
                **kwargs
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"The chat template rejected these messages: {exc}") from exc


def _chat_environment() -> Any:
    """A sandboxed Jinja environment set up like transformers' chat-template renderer."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; render it as-is.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back bytes of a character that is not
    complete yet (a multi-byte UTF-8 character can span several byte-level tokens).

    It decodes a short window of recent ids, not the whole history, so each push costs O(1); the window
    starts one step back so tokenizers that drop a leading space (sentencepiece) keep it."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this were already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated character at the end of generation)."""
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(done):]
