"""Tokenizer wrapper: SmolLM2 ids and chat template against transformers, round trips, streaming,
and the error paths on small synthetic folders."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from blockspec.errors import ModelLoadError, RequestError
from blockspec.models.default_model import gguf_path
from blockspec.models.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # rec\n",
    "x = 12345 + 6789; y = 3.14159e-5",
    "Ünïcödé façade — naïve café, 日本語のテキスト, русский, العربية",
    "emoji 🤖🎉👍🏽 and a family 👨‍👩‍👧 ZWJ",
    "   leading and trailing   ",
    "tabs\tand\r\nCRLF\n\n\n    indented\n\t\tdeeper",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "it's they're we'll I'd DON'T",
    "<repo_name>demo<file_sep>main.py\n<|endoftext|>",
    "",
    "if (a<b && c>d) { return x->y; } // ok",
    "Ġ Ċ ĉ literal byte-alphabet characters",
]
# SmolLM2's GGUF says pre-tokenizer "smollm": every digit is its own piece *before* the GPT-2 split
# (as in llama.cpp and the original tokenizer.json). transformers' GGUF loader does not know that name
# and falls back to the plain GPT-2 split, so the two disagree exactly when whitespace precedes a digit.
DIVERGENT = ["a  1", "\n 1", "x = 1;\n\n 7"]
WS_THEN_DIGIT = re.compile(r"\s\d")


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


@pytest.fixture(scope="module")
def hf_gguf_tok():
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_ids_match_transformers_gguf_tokenizer(tok: Tokenizer, hf_gguf_tok) -> None:
    for text in TEXTS:
        assert tok.encode(text) == hf_gguf_tok.encode(text, add_special_tokens=False), text
    assert tok.encode("<|im_start|>user")[0] == 1  # special tokens stay whole


def test_digits_are_split_as_the_model_was_trained(tok: Tokenizer, hf_gguf_tok, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    for text in DIVERGENT:
        ids = tok.encode(text)
        assert ids != hf_gguf_tok.encode(text, add_special_tokens=False)
        assert ids[-1] == tok.token_to_id(text[-1])
        assert ids == tok.encode(text[:-1]) + [tok.token_to_id(text[-1])]
    # Every disagreement with transformers' GGUF tokenizer is that one case; our folder itself loads
    # in transformers and tokenizes exactly like us.
    ours_in_hf = AutoTokenizer.from_pretrained(smollm2_dir)
    rng = random.Random(0)
    alphabet = "ab Z\n\t 0123456789 é日🤖'.,;<>|_-"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        ids = tok.encode(text)
        assert ids == ours_in_hf.encode(text, add_special_tokens=False)
        if ids != hf_gguf_tok.encode(text, add_special_tokens=False):
            assert WS_THEN_DIGIT.search(text), text


def test_chat_template_matches_transformers(tok: Tokenizer, hf_gguf_tok) -> None:
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Write 2 lines\nof code 🤖"}]
    for messages in (convo, [{"role": "system", "content": "Be terse."}] + convo, convo[:1]):
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf_gguf_tok.apply_chat_template(messages, add_generation_prompt=gen,
                                                           tokenize=False)
    text = tok.apply_chat_template(convo[:1])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_decode_round_trips(tok: Tokenizer) -> None:
    for text in TEXTS + DIVERGENT:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    ids = tok.encode("<|im_start|>assistant\nParis.<|im_end|>")
    assert tok.decode(ids) == "assistant\nParis."


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token_ids == frozenset({0, 2})  # <|im_end|> and, from generation_config, <|endoftext|>
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("no-such-token!") is None


def test_stream_decoder_holds_back_split_characters(tok: Tokenizer) -> None:
    text = "emoji 🤖🎉👍🏽 日本語 and <|im_end|> ok 1  2"
    ids = tok.encode(text)
    stream = StreamDecoder(tok, skip_special_tokens=False)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert "" in pieces and not any("\ufffd" in p for p in pieces)  # some token ended mid-character
    truncated = StreamDecoder(tok)
    pieces = [truncated.push(i) for i in tok.encode("🤖")[:-1]]
    assert pieces == [""] * len(pieces) and truncated.flush().endswith("\ufffd")


# ---- any HF folder: synthetic tokenizers -------------------------------------------------------


def _folder(tmp_path: Path, config: dict | None = None, generation: dict | None = None,
            jinja: str | None = None, tokenizer: bool = True) -> Path:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<|im_end|>", "hello", "world", "!"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(w, special=True) for w in words[:4]])
    if tokenizer:
        backend.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


# Exercises whitespace control, loop controls, namespace, tojson, raise_exception and strftime_now.
RICH_TEMPLATE = """{%- if tools %}{{ bos_token }}TOOLS: {{ tools | tojson }}
{% endif %}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role not in ['user', 'assistant', 'system'] %}\
{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<{{ m.role }}:{{ ns.n }}> {{ m.content | trim }}{{ eos_token if m.role == 'assistant' }}
{% endfor %}
{%- if add_generation_prompt %}<assistant:{{ ns.n + 1 }}>{% endif %}
{%- if date %} {{ strftime_now('%Y') | length }}{% endif %}
"""


def test_rich_template_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
              "chat_template": RICH_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    folder = _folder(tmp_path, config)
    ours, ref = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": " hi \n"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ünï"}]
    tools = [{"name": "f", "description": "ü", "parameters": {}}]
    for kwargs in ({}, {"tools": tools}, {"date": True}, {"add_generation_prompt": False}):
        rendered = ours.apply_chat_template(messages, **{"add_generation_prompt": True, **kwargs})
        assert rendered == ref.apply_chat_template(messages, tokenize=False,
                                                   **{"add_generation_prompt": True, **kwargs})
    with pytest.raises(RequestError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    assert ours.eos_token_ids == frozenset({2}) and ours.bos_token_id == 1


def test_eos_ids_chatml_and_generation_config(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_folder(tmp_path, {"eos_token": "</s>"}, {"eos_token_id": [0, 5]},
                                        jinja="{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
                                              "{% endfor %}"))
    assert tok.chat_template is not None and tok.chat_template.startswith("{% for")  # .jinja file wins
    assert tok.eos_token_ids == frozenset({2, 3, 0, 5})
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "<|im_start|>hello<|im_end|>"


def test_no_chat_template_asks_for_a_plain_prompt(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_folder(tmp_path, {"eos_token": "</s>"}))
    assert tok.chat_template is None
    with pytest.raises(RequestError, match="no chat template.*plain prompt"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert tok.encode("hello world !") == [4, 5, 6] and tok.decode([1, 4, 5, 2]) == "hello world"


def test_bad_folders(tmp_path: Path) -> None:
    empty = tmp_path / "a"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is missing.*save_pretrained"):
        Tokenizer.from_folder(_folder(empty, {}, tokenizer=False))
    bad = tmp_path / "b"
    bad.mkdir()
    _folder(bad)
    (bad / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_folder(bad)
    (bad / "tokenizer_config.json").write_text("{}")
    (bad / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ModelLoadError, match="could not be parsed"):
        Tokenizer.from_folder(bad)


def test_bad_messages(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_folder(tmp_path, {"chat_template": "{{ messages[0].content }}"}))
    with pytest.raises(RequestError, match="list of objects"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="prompt must be a string"):
        tok.encode(None)  # type: ignore[arg-type]
