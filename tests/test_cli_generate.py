"""`blockspec generate --json` prints exactly one JSON object with the promised fields; bad input exits 2."""

import json
import subprocess
import sys

import pytest

from blockspec import LLM, SamplingParams
from blockspec.models.config import ModelConfig
from blockspec.errors import BlockspecError, RequestError
from tests.tiny import write_tiny_draft, write_tiny_target, write_tiny_tokenizer

FIELDS = {  # INTERFACE.md's, plus the rest of the request's statistics (adaptive speculation, prompt lookup,
    # the prefix cache, each token's source)
    "text", "token_ids", "num_prompt_tokens", "num_output_tokens", "finish_reason", "speculative_algorithm",
    "block_size", "accept_lengths", "mean_accept_length", "time_to_first_token_s", "decode_tokens_per_s",
    "num_verify_steps", "num_tree_steps", "num_plain_steps", "lookup_accept_lengths", "num_lookup_steps",
    "lookup_mean_accept_length", "merged_accept_lengths", "num_merged_steps", "merged_mean_accept_length",
    "cached_tokens", "token_sources",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = write_tiny_tokenizer(write_tiny_target(root / "target"))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    return str(target), str(draft)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "blockspec", "generate", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("algorithm", ["DFLASH", "NONE"])
def test_generate_json(tiny, algorithm):
    target, draft = tiny
    proc = run_cli("hello world", "--chat", "--json", "--model-path", target, "--draft-model-path", draft,
                   "--speculative-algorithm", algorithm, "--max-new-tokens", "20")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(report) == FIELDS
    assert report["speculative_algorithm"] == algorithm
    assert report["num_output_tokens"] == len(report["token_ids"]) <= 20
    assert report["finish_reason"] in ("stop", "length")
    limit = 4 if algorithm == "DFLASH" else 1
    assert report["block_size"] == limit and all(1 <= a <= limit for a in report["accept_lengths"])
    assert all(1 <= a <= 4 for a in report["lookup_accept_lengths"])  # default width max(4, B)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "1"], "block"),
        (["--mask-token-id", "500"], "--mask-token-id=500 is outside the target embedding"),
        (["--temperature", "-1"], "temperature=-1"),
        (["--max-new-tokens", "0"], "--max-new-tokens=0 must be an integer >= 1"),
        (["--prompt-lookup-ngram", "-1"], "--prompt-lookup-ngram=-1 must be an integer in [0, 64]"),
        (["--speculative-algorithm", "DFLASH", "--draft-model-path", "/no/such/draft"], "does not exist"),
    ],
)
def test_bad_input_exits_2(tiny, args, message):
    target, draft = tiny
    if "--draft-model-path" not in args:
        args = [*args, "--draft-model-path", draft]
    proc = run_cli("hi", "--model-path", target, *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_length_error_names_the_flags(tiny):
    """Too many new tokens for the context: the message names --max-new-tokens, not the API's max_tokens."""
    target, draft = tiny
    proc = run_cli("hi", "--model-path", target, "--draft-model-path", draft, "--max-new-tokens", "99999")
    assert proc.returncode == 2, proc.stderr
    assert "--max-new-tokens=99999" in proc.stderr and "--max-model-len=" in proc.stderr
    assert "max_tokens" not in proc.stderr and "lower --max-new-tokens (to at most" in proc.stderr


def test_api_lengths_and_prompts(tiny):
    target, draft = tiny
    llm = LLM(model_path=target, draft_model_path=draft, max_model_len=64)
    with pytest.raises(RequestError, match="exceed the context length max_model_len=64"):
        llm.generate("a" * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 1000]])
    with pytest.raises(BlockspecError, match="speculative_algorithm"):
        LLM(model_path=target, speculative_algorithm="EAGLE")
    with pytest.raises(BlockspecError,
                       match=r"prompt_lookup_ngram=-1 must be an integer in \[0, 64\] .*0: off"):
        LLM(model_path=target, prompt_lookup_ngram=-1)
    with pytest.raises(BlockspecError, match=r"prompt_lookup_block_size=1 must be an integer in \[2, 64\]"):
        LLM(model_path=target, prompt_lookup_block_size=1)
    outs = llm.generate(["abc", "hello"], [SamplingParams(max_tokens=5),
                                           SamplingParams(max_tokens=7, temperature=0.9, seed=3)])
    assert [len(o.token_ids) <= n for o, n in zip(outs, (5, 7))] == [True, True]
    plain = llm.generate(["abc", "hello"], SamplingParams(max_tokens=12), speculative_algorithm="NONE")
    spec = llm.generate(["abc", "hello"], SamplingParams(max_tokens=12))
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
